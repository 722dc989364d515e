#!/usr/bin/env bash
# The MoE checks for a CUDA machine, in one short run from the repository root:
#     bash benchmarks/moe/run_gpu.sh [LAYERS]
# 1. the fused-MoE kernel tests natively (the Triton grouped GEMM in fp32, fp16 and bf16 against
#    the loop over experts) and Mixtral end to end on the Triton kernels;
# 2. bench_moe.py on the GPU: the Triton kernel against the loop on an OLMoE-1B-7B-shaped model
#    of LAYERS decoder layers (default 16, the whole model: ~13 GB of bf16 weights).
# Writes benchmarks/moe/olmoe-1b-7b-bfloat16-cuda.json; exits non-zero if a test fails.
set -euo pipefail
python=${PYTHON:-python}
$python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'benchmarks/moe/run_gpu.sh: no CUDA device')"
$python -m pytest -q -x tests/kernels/test_fused_moe.py tests/kernels/test_engine_triton_moe.py
$python benchmarks/moe/bench_moe.py --device cuda --layers "${1:-16}" --num-prompts 256 --input-len 512 \
    --output-len 128
