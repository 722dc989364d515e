"""Writes a llama.cpp-quantized copy of a GGUF file with llama.cpp's own quantizer (the one `llama-quantize`
runs), for the benchmarks' Q4_K_M row. It runs in llama.cpp's venv:

    ~/.cache/llamacpp/venv/bin/python benchmarks/quant/llamacpp_quantize.py SRC.gguf DST.gguf Q4_K_M

For SmolLM2-135M (rows of 576, not a multiple of 256) llama.cpp writes most tensors of a Q4_K_M file
as Q5_0, as it does for any model whose rows don't split into 256-element super-blocks."""

import ctypes
import sys

import llama_cpp

src, dst, kind = sys.argv[1:4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
params.allow_requantize, params.nthread = True, 2
if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
    sys.exit(f"llama.cpp could not quantize {src} to {kind}")
print(dst)
