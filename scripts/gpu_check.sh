#!/usr/bin/env bash
# One command on a CUDA machine, from anywhere:  bash scripts/gpu_check.sh
#  1. tests/kernels natively on the GPU (bf16 included), sharded over processes because
#     Triton compilation, not the GPU, dominates its time;
#  2. the tensor-parallel equality check (tests/distributed -k tp2_cuda) when 2+ GPUs exist;
#  3. python3 -m nanoserve.bench.kernels: per-kernel correctness against the torch reference
#     (bf16, fp16) and microbenchmarks, written as kernels.json / kernels.md to $OUT, else
#     benchmarks/gpu/.
# Needs torch + triton; pytest is optional (step 1 and 2 are skipped, with a message, without it).
# Exit status: 0 all passed, 1 something failed, 2 no CUDA device.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/gpu}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET NANOSERVE_KERNELS

if [ "${GPU_CHECK_WITHOUT_GPU:-0}" = 1 ]; then
    echo "gpu_check: GPU_CHECK_WITHOUT_GPU=1: exercising this script on a CPU (tests interpreted)"
elif ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch ($PY), nothing to check here." >&2
    echo "gpu_check: on a CPU run the interpreter suite instead: python -m pytest tests/kernels" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
status=0
started=$SECONDS

have_pytest=1
$PY -c "import pytest" 2>/dev/null || have_pytest=0
PYTEST_ARGS=(-q -p no:cacheprovider)
if [ $have_pytest = 1 ] && ! $PY -c "import tests.conftest, tests.fixtures_models" 2>/dev/null; then
    echo "gpu_check: tests/conftest.py does not import here (a package it needs is missing):"
    echo "           running with --noconftest, without the engine test that needs its fixture"
    PYTEST_ARGS+=(--noconftest --ignore=tests/kernels/test_engine_triton.py)
fi

# ---- 1. kernel tests ---------------------------------------------------------------------
if [ $have_pytest = 1 ]; then
    logs=$(mktemp -d)
    shards=(
        "tests/kernels/test_attention.py::test_mixed_prefill_and_decode"
        "tests/kernels/test_attention.py --deselect tests/kernels/test_attention.py::test_mixed_prefill_and_decode"
        "tests/kernels --ignore=tests/kernels/test_attention.py"
    )
    pids=()
    for i in "${!shards[@]}"; do
        # shellcheck disable=SC2086  # each shard string is a word list on purpose
        $PY -m pytest "${PYTEST_ARGS[@]}" ${shards[$i]} >"$logs/shard$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        if wait "${pids[$i]}"; then result=passed; else result=FAILED; status=1; fi
        echo "== pytest ${shards[$i]}: $result"
        tail -n 25 "$logs/shard$i.log"
    done
    cat "$logs"/shard*.log >"$OUT_DIR/pytest_kernels.log"
    rm -rf "$logs"
    echo "gpu_check: kernel tests done after $((SECONDS - started)) s"
else
    echo "gpu_check: pytest is not installed here: skipping tests/kernels; the benchmark below"
    echo "           still checks every kernel against its torch reference in bf16 and fp16."
fi

# ---- 2. tensor parallel equality on 2 GPUs ----------------------------------------------
num_gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$num_gpus" -lt 2 ]; then
    echo "gpu_check: skipping the tp=2 check (tests/distributed -k tp2_cuda): $num_gpus GPU here"
elif [ $have_pytest = 0 ]; then
    echo "gpu_check: skipping the tp=2 check: pytest is not installed"
elif [ ! -d tests/distributed ]; then
    echo "gpu_check: skipping the tp=2 check: tests/distributed does not exist yet"
else
    $PY -m pytest "${PYTEST_ARGS[@]}" tests/distributed -k tp2_cuda
    rc=$?
    if [ $rc = 5 ]; then
        echo "gpu_check: no test matched tests/distributed -k tp2_cuda"
    elif [ $rc != 0 ]; then
        status=1
    fi
fi

# ---- 3. microbenchmarks ------------------------------------------------------------------
$PY -m nanoserve.bench.kernels --out "$OUT_DIR" || status=1
echo "gpu_check: finished in $((SECONDS - started)) s, status $status"
exit $status
