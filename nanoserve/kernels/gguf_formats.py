"""The GGUF block formats' tables, shared by the CPU kernels (kernels/quant.py, gemm_quant.cpp,
decode_layers.cpp) and the Triton kernel (kernels/quant_triton.py), which know each format by the
same number."""

from __future__ import annotations

# name -> (elements per block, bytes per block), as stored in a GGUF file.
GGUF_QTYPES: dict[str, tuple[int, int]] = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}

# name -> (4-bit weights, elements per scale, integer offset, has a min); the kernels' format code
# (format_code) is the index in this dict (new formats go at the end: the codes are kept). The
# 5-bit formats are a byte an element to the CPU kernel (u <= 31), as Q8_0 and Q6_K.
FORMATS: dict[str, tuple[bool, int, int, bool]] = {
    "q8_0": (False, 32, 128, False),
    "q4_0": (True, 32, 8, False),
    "q4_1": (True, 32, 0, True),
    "q4_k": (True, 32, 0, True),
    "q6_k": (False, 16, 32, False),
    "q5_0": (False, 32, 16, False),
    "q5_1": (False, 32, 0, True),
    "q5_k": (False, 32, 0, True),
    # Not a GGUF type: FP8 (E4M3) weights with a scale per 32 (kernels/quant.py's FP8;
    # kernels/cpu/gemm_fp8.cpp); `u` holds the E4M3 bytes, the offset means nothing.
    "fp8_e4m3": (False, 32, 0, False),
    # Not a GGUF type here either: MXFP4 (models/mxfp4.py), `u` holds the 4-bit E2M1 codes, which
    # the kernels decode through a table to 12 + 2 x the value (kernels/quant.py's MXFP4_U).
    "mxfp4": (True, 32, 12, False),
    # Q5_K and Q6_K packed in 4-bit nibbles and bit planes of the high bits (kernels/quant.py's
    # PLANES): the same elements, scales and arithmetic, fewer bytes; AVX2 and portable kernels.
    "q5_k/planes": (False, 32, 0, True),
    "q6_k/planes": (False, 16, 32, False),
}


def format_code(qtype: str) -> int:
    """The format number kernels/cpu/gemm_quant.cpp, decode_layers.cpp and quant_triton.py's
    kernel know qtype by."""
    return list(FORMATS).index(qtype)
