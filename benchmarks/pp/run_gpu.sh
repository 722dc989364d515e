#!/usr/bin/env bash
# Pipeline against tensor parallelism on GPUs (NCCL): tp=1, tp=2 and pp=2 (and tp=2 x pp=2 with
# 4+ GPUs) on a Llama-3.2-1B-shaped random model. Needs 2+ GPUs; run from the repository root:
#     bash benchmarks/pp/run_gpu.sh [OUT_JSON]
# Writes the JSON (default benchmarks/pp/gpu-llama1b-bf16.json) and exits non-zero if any
# configuration's greedy tokens differ from tp=1's.
set -euo pipefail
python=${PYTHON:-python}
gpus=$($python -c "import torch; print(torch.cuda.device_count())")
if (( gpus < 2 )); then
    echo "benchmarks/pp/run_gpu.sh: needs 2+ GPUs, this machine has $gpus" >&2
    exit 2
fi
model=${MODEL_DIR:-/tmp/nanoserve-llama1b}
[[ -f $model/config.json ]] || $python scripts/make_random_llama.py "$model" --shape llama-3.2-1b --device cuda
configs=(tp1 tp2 pp2)
(( gpus >= 4 )) && configs+=(tp2pp2 pp4)
$python -m nanoserve.bench.pipeline --model "$model" --device cuda --dtype bfloat16 \
    --configs "${configs[@]}" --num-prompts 256 --input-len 512 --output-len 128 \
    --output "${1:-benchmarks/pp/gpu-llama1b-bf16.json}"
