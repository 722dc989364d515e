#!/bin/bash
# Quantized GGUF serving (issue 28) against llama.cpp and against nanoserve's own bf16, in one run
# on this machine, each engine in a process of its own, one after the other. Run on an idle
# machine from the project root after `make install` and ../shared/bench/setup-llamacpp.sh (which
# writes the default model as Q4_1, Q8_0 and BF16 GGUF files). Writes $OUT/run.txt.
#   benchmarks/quant/bench_quant.sh                                   batch1, offline and perplexity
#   PARTS="batch1" OUT=benchmarks/quant/amd-epyc-zen5 benchmarks/quant/bench_quant.sh
# batch1: 16-token prompt, 256 greedy tokens, ms/token (../shared/bench/batch1.sh): llama.cpp on
#   the three files and llama.cpp's Q4_K_M, nanoserve on its bf16 import and on the quantized files
#   as they are.
# offline: LLM.generate 64 x (128 in, 128 out) output tokens/s, nanoserve bf16 vs the Q4_1 file.
# prefill: prompt-only work, nanoserve LLM.generate 64 x (128 in, 1 out) and llama.cpp one 512-token
#   prompt (benchmarks/quant/prefill_llamacpp.py), each on bf16 / Q4_1 / Q8_0: the gain each engine gets
#   from a quantized file where the work is compute-bound.
# ppl: scripts/perplexity.py on benchmarks/quant/perplexity_text.txt (the same ids for both);
#   PPL_TEXT=benchmarks/quant/perplexity_text_long.txt for the 4x longer text (its first 16 windows
#   are the short text's).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/quant}
PARTS=${PARTS:-"batch1 offline prefill ppl"}
BENCH=${BENCH:-../shared/bench}
LV=${LLAMACPP_VENV:-$HOME/.cache/llamacpp/venv}
G=$(dirname "$LV")/gguf
PY=.venv/bin/python
PPL_TEXT=${PPL_TEXT:-benchmarks/quant/perplexity_text.txt}
MODEL_DIR=${MODEL_DIR:-$($PY -c 'from nanoserve.models.gguf.importer import ensure_default_model; print(ensure_default_model())' 2>/dev/null)}
mkdir -p "$OUT"
RUN="$OUT/run.txt"
# llama.cpp's Q4_K_M of the default model (mostly Q5_0 at its row length), written once from the BF16 file
[ -f "$G/smollm2-q4_k_m.gguf" ] || "$LV/bin/python" benchmarks/quant/llamacpp_quantize.py "$G/smollm2-bf16.gguf" \
  "$G/smollm2-q4_k_m.gguf" Q4_K_M >/dev/null 2>&1
{
  echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB"
  echo "# torch $($PY -c 'import torch; print(torch.__version__)'), nanoserve $(git rev-parse --short HEAD)"
  echo "# $($PY -c 'from nanoserve.kernels.cpu import ops as cpu_ops; print(cpu_ops.describe_isa())' 2>/dev/null)"
} > "$RUN"
offline() {  # model label
  $PY -m nanoserve.bench.throughput --model "$1" --num-prompts 64 --input-len 128 --output-len 128 \
    --no-transformers 2>/dev/null | grep '^nanoserve' | sed "s/^nanoserve/nanoserve $2/"
}
for part in $PARTS; do
  case $part in
    batch1) echo "## batch1" | tee -a "$RUN"
            "$BENCH/batch1.sh" "$G/smollm2-q4_1.gguf" "$G/smollm2-q8_0.gguf" "$G/smollm2-q4_k_m.gguf" 2>/dev/null \
              | grep -E '^(nanoserve|llama.cpp)' | tee -a "$RUN"
            "$LV/bin/python" "$BENCH/batch1_llamacpp.py" "$G/smollm2-q4_k_m.gguf" 2>/dev/null | tail -n 1 | tee -a "$RUN" ;;
    offline) echo "## offline 64 128 128" | tee -a "$RUN"
             offline "$MODEL_DIR" bf16 | tee -a "$RUN"
             offline "$G/smollm2-q4_1.gguf" q4_1 | tee -a "$RUN"
             offline "$G/smollm2-q8_0.gguf" q8_0 | tee -a "$RUN" ;;
    prefill) echo "## prefill" | tee -a "$RUN"  # compute-bound: what the formats' per-block work costs
             for m in "$MODEL_DIR" "$G/smollm2-q4_1.gguf" "$G/smollm2-q8_0.gguf"; do
               $PY -m nanoserve.bench.throughput --model "$m" --num-prompts 64 --input-len 128 --output-len 1 \
                 --no-transformers 2>/dev/null | grep '^nanoserve' | sed "s|^nanoserve|nanoserve prefill $(basename "$m")|" | tee -a "$RUN"
             done
             for m in "$G/smollm2-bf16.gguf" "$G/smollm2-q4_1.gguf" "$G/smollm2-q8_0.gguf"; do
               "$LV/bin/python" benchmarks/quant/prefill_llamacpp.py "$m" 2>/dev/null | tee -a "$RUN"
             done ;;
    ppl) echo "## perplexity" | tee -a "$RUN"
         NLL=$(mktemp -d)
         echo "# text: $PPL_TEXT" | tee -a "$RUN"
         $PY scripts/perplexity.py tokenize "$MODEL_DIR" "$PPL_TEXT" "$NLL/ids" 2>/dev/null
         for m in "$MODEL_DIR" "$G/smollm2-q8_0.gguf" "$G/smollm2-q4_1.gguf"; do
           for dtype in bfloat16 float32; do  # llama.cpp's activations are fp32
             $PY scripts/perplexity.py nanoserve "$m" "$NLL/ids" $dtype --nll "$NLL/ns-$(basename "$m")-$dtype" \
               2>/dev/null | tail -n 1 | tee -a "$RUN"
           done
         done
         $PY scripts/perplexity.py nanoserve "$G/smollm2-q4_k_m.gguf" "$NLL/ids" bfloat16 \
           --nll "$NLL/ns-smollm2-q4_k_m.gguf-bfloat16" 2>/dev/null | tail -n 1 | tee -a "$RUN"
         for m in "$G/smollm2-bf16.gguf" "$G/smollm2-q8_0.gguf" "$G/smollm2-q4_1.gguf" "$G/smollm2-q4_k_m.gguf"; do
           "$LV/bin/python" scripts/perplexity.py llamacpp "$m" "$NLL/ids" --nll "$NLL/lc-$(basename "$m")" \
             2>/dev/null | tail -n 1 | tee -a "$RUN"
         done
         # paired ratios, token by token on the same ids, with a 95% interval over the windows
         for pair in "ns-smollm2-q4_1.gguf-bfloat16 lc-smollm2-q4_1.gguf" "ns-smollm2-q4_1.gguf-float32 lc-smollm2-q4_1.gguf" \
                     "ns-$(basename "$MODEL_DIR")-float32 lc-smollm2-bf16.gguf" \
                     "ns-smollm2-q8_0.gguf-bfloat16 ns-$(basename "$MODEL_DIR")-bfloat16" \
                     "ns-smollm2-q4_k_m.gguf-bfloat16 lc-smollm2-q4_k_m.gguf"; do
           set -- $pair
           $PY scripts/perplexity.py compare "$NLL/$1" "$NLL/$2" | tee -a "$RUN"
         done
         rm -rf "$NLL" ;;
  esac
done
$PY benchmarks/quant/summarize_quant.py "$RUN" | tee "$OUT/summary.md"
