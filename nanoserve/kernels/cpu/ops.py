"""The CPU kernels of kernels/cpu/ops.cpp: built once per machine with the system C++ compiler,
loaded with ctypes (no torch headers, so the build takes about a second), called with raw
pointers. Every op here has a torch reference beside its Triton kernel; these are the CPU
execution path when they load, and the references are used when they don't (no compiler,
an unsupported dtype or layout). ``NANOSERVE_KERNELS=reference`` turns them off.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from nanoserve import envs
from nanoserve.kernels.choice import kernel_choice
from nanoserve.kernels.kv_dtype import FP8_CODES

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / name
    for name in (
        "ops.cpp",
        "gemm.cpp",
        "gemm_levels.cpp",
        "attention_amx.cpp",
        "decode_layers.cpp",
        "gemm_quant.cpp",
        "gemm_fp8.cpp",
        "kv_fp8.cpp",
        "moe.cpp",
    )
]
# In the build's cache key with the sources.
_HEADERS = [Path(__file__).parent / name for name in ("simd.h", "isa.h", "bf16.h", "fp8.h")]
# -ffp-contract=off: no fused multiply-adds the torch references don't do (explicit FMAs in the
# AVX-512 paths are unaffected).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-std=c++17",
]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ROWS_PER_ITEM = 16  # query rows that share one pass over a K/V block in prefill

_library: ctypes.CDLL | None = None
_load_error: str | None = None

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_SIGNATURES = {
    "ns_paged_attention": [
        _I32,
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        _I32,
        _P,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        ctypes.c_float,
        _I32,
    ],
    "ns_rms_norm": [_I32, _P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float],
    "ns_silu_and_mul": [_I32, _P, _P, _I64, _I64],
    "ns_argmax_rows": [_I32, _P, _P, _I64, _I64, _I64],
    "ns_gemm_bf16": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64],
    "ns_gemm_quant": [_I32, _P, _I64, _P, _I64, _I32, _P, _P, _I64, _I64, _I64],
    "ns_gemm_quant_many": [_I32, _P, _I64, _I32],
    "ns_moe_topk": [_I32, _P, _I64, _I64, _I32, _I32, _I32, _P, _P],
    "ns_moe_experts": [_P, _I32, _P, _P, _P, _P, _I64, _I32, _I64, _I64, _P],
    "ns_isa_supported": [_I32],
    "ns_bf16_dot_variant": [_I32],
    "ns_set_isa": [_I32],
    "ns_current_isa": [],
    "ns_gemm_quant_vnni": [],
    "ns_decode_attention_amx": [
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        _P,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        ctypes.c_float,
    ],
    "ns_prefill_attention": [
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        _P,
        _I64,
        _P,
        _I32,
        _I32,
        ctypes.c_float,
    ],
    "ns_decode_layers": [
        _P,
        _I32,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _I32,
        _I32,
        _I32,
        ctypes.c_float,
        ctypes.c_float,
        _P,
        _P,
        _I64,
        _P,
        _I32,
        _P,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        _P,
        _P,
        _I32,
        _I32,
        _P,
        _P,
    ],
    "ns_rotary_store": [
        _I32,
        _P,
        _I64,
        _I64,
        _I32,
        _I32,
        _I32,
        _P,
        _P,
        _I64,
        _P,
        _P,
        _I32,
        _P,
        _I32,
    ],
    "ns_paged_attention_fp8": [
        _I32,
        _I32,
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        _I32,
        _P,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        ctypes.c_float,
        _I32,
        _I32,
    ],
    "ns_prefill_attention_fp8": [
        _I32,
        _P,
        _P,
        _I64,
        _I64,
        _P,
        _P,
        _I32,
        _I32,
        _P,
        _I64,
        _P,
        _I32,
        _I32,
        ctypes.c_float,
    ],
    "ns_fp8_from_float": [_I32, _P, _P, _I64],
    "ns_fp8_widen": [_I32, _I32, _P, _P, _I64],
}


def _cpu_signature() -> str:
    """What -march=native compiles for: rebuild on a machine with other CPU features."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    sources = b"".join(source.read_bytes() for source in _SOURCES + _HEADERS)
    key = hashlib.sha256(sources + " ".join(_FLAGS).encode() + _cpu_signature().encode())
    return envs.nanoserve_home() / "cpu-kernels" / key.hexdigest()[:16]


def compiler() -> str | None:
    return envs.cxx() or shutil.which("g++") or shutil.which("c++")


def build_command(compiler: str, output: Path, march: str = "native") -> list[str]:
    """The compiler's command line for the library; `march` other than native compiles for another
    CPU (tests build every x86-64 level, whatever CPU runs them)."""
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in _FLAGS]
    return [compiler, *flags, *map(str, _SOURCES), "-o", str(output)]


def _build(target: Path) -> None:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # servers started side by side build once
        if target.exists():
            return
        print(
            f"nanoserve: compiling the CPU kernels (once per machine) into {target.parent}",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(build_command(cxx, built), capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling the CPU kernels failed:\n{result.stderr[-2000:]}")
            os.replace(built, target)


def load(path: Path) -> ctypes.CDLL:
    """A build of the kernels at `path`, its functions typed (benchmarks/ab_kernels.py loads two)."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (and why, in load_error()) when they can't be built here."""
    global _library, _load_error
    if _library is not None or _load_error is not None:
        return _library
    try:
        target = _cache_dir() / "libnanoserve_cpu.so"
        if not target.exists():
            _build(target)
        lib = load(target)
        _set_level(lib, _chosen_isa(lib))
        _library = lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        _load_error = str(error)
        logger.warning("CPU kernels unavailable, using the torch references: %s", error)
    return _library


# ---- ISA levels (kernels/cpu/isa.h) ----------------------------------------------------------
# Lowest first; the index is the level's number in isa.h.
ISA_LEVELS = ("portable", "avx2", "avx512bf16", "amx")
ISA_DESCRIPTIONS = {
    "portable": "plain C++",
    "avx2": "AVX2 + FMA, fp32 accumulation of bf16",
    "avx512bf16": "AVX-512 with AVX512_BF16 (vdpbf16ps)",
    "amx": "AMX-BF16 tiles",
}


def _supported(lib: ctypes.CDLL) -> list[str]:
    return [name for level, name in enumerate(ISA_LEVELS) if lib.ns_isa_supported(level)]


def _chosen_isa(lib: ctypes.CDLL) -> str:
    """NANOSERVE_CPU_ISA when set (it must name a level this CPU runs), else the best one here."""
    supported = _supported(lib)
    forced = envs.cpu_isa()
    if not forced:
        return supported[-1]
    if forced not in ISA_LEVELS:
        raise IsaError(f"NANOSERVE_CPU_ISA must be one of {', '.join(ISA_LEVELS)}, got {forced!r}")
    if forced not in supported:
        raise IsaError(
            f"NANOSERVE_CPU_ISA={forced}: this CPU can't run that level "
            f"(it runs {', '.join(supported)})"
        )
    return forced


class IsaError(ValueError):
    """NANOSERVE_CPU_ISA names no level, or one this CPU can't run."""


def _set_level(lib: ctypes.CDLL, name: str) -> None:
    if lib.ns_set_isa(ISA_LEVELS.index(name)) != 0:
        raise IsaError(f"this CPU can't run the {name} kernels")


def supported_isas() -> list[str]:
    """The levels this machine can run, lowest first ([] when the kernels don't load): tests run
    each of them."""
    lib = library()
    return [] if lib is None else _supported(lib)


def isa() -> str | None:
    """The level every CPU kernel runs at in this process; None when the kernels don't load."""
    lib = library()
    return None if lib is None else ISA_LEVELS[lib.ns_current_isa()]


def set_isa(name: str) -> str:
    """Run every CPU kernel at this level from now on (tests, benchmarks); returns the previous
    one. One packing of the weights serves every level, so models need not be rebuilt."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not loaded: {_load_error}")
    if name not in ISA_LEVELS:
        raise IsaError(f"unknown ISA level {name!r}; one of {', '.join(ISA_LEVELS)}")
    previous = isa()
    _set_level(lib, name)
    return previous


def describe_isa() -> str:
    """For the startup log line: the level chosen and why it is that one."""
    chosen = isa()
    if chosen is None:
        return f"CPU kernels unavailable ({_load_error}): torch's own"
    forced = envs.cpu_isa()
    how = "NANOSERVE_CPU_ISA" if forced else "best this CPU runs"
    what = ISA_DESCRIPTIONS[chosen]
    if chosen == "avx512bf16" and bf16_dot_variant() == "fma":
        what += "; the bf16 GEMM and prompt attention on fp32 FMAs, VDPBF16PS measured slow here"
    return f"CPU kernels: {chosen} ({what}; {how}; this CPU runs {', '.join(supported_isas())})"


BF16_DOT_VARIANTS = ("vdpbf16ps", "fma")


def bf16_dot_variant(force: str | None = None) -> str:
    """How the AVX-512 BF16 level multiplies bf16 in its GEMM and its prompt attention
    (kernels/cpu/gemm_levels.cpp, attention_amx.cpp; the same bits either way, chosen at first use
    by timing the two instructions): "vdpbf16ps" or "fma". Tests force one with `force`, or
    "measured" to go back to the timed choice."""
    if library() is None:
        return BF16_DOT_VARIANTS[0]
    code = -1 if force is None else 2 if force == "measured" else BF16_DOT_VARIANTS.index(force)
    return BF16_DOT_VARIANTS[_library.ns_bf16_dot_variant(code)]


def load_error() -> str | None:
    return _load_error


def available() -> bool:
    """Whether the CPU path may use these kernels: they load, and NANOSERVE_KERNELS doesn't ask
    for the references or the Triton kernels instead."""
    return kernel_choice() == "auto" and library() is not None


def _dtype_code(*tensors: torch.Tensor) -> int | None:
    """The kernels' code for these tensors' dtype; None when the kernels can't take them (or
    aren't loaded)."""
    if _library is None and library() is None:
        return None
    dtype = tensors[0].dtype
    for t in tensors:  # a plain loop: this runs several hundred times a step
        if t.dtype != dtype or not t.is_cpu:
            return None
    return _DTYPES.get(dtype)


def _kv_format(
    code: int | None, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> int | None:
    """The pools' format for the kernels (0: the query's dtype, else fp8.h's code), None when the
    kernels can't take this query and these pools. `code`: the query's _dtype_code."""
    if (
        code is None
        or key_cache.dtype != value_cache.dtype
        or not (key_cache.is_cpu and value_cache.is_cpu)
    ):
        return None
    if key_cache.dtype == query.dtype:
        return 0
    return FP8_CODES.get(key_cache.dtype)


def _head_major(cache: torch.Tensor) -> bool:
    """[blocks, block_size, kv_heads, dim] seen over contiguous [blocks, kv_heads, block_size, dim]
    (strides checked directly: a permute per call per layer costs more than the check)."""
    if cache.dim() != 4:
        return False
    _, block_size, kv_heads, dim = cache.shape
    return cache.stride() == (kv_heads * block_size * dim, dim, block_size * dim, 1)


def paged_attention(
    query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale, out=None
):
    """Same contract as kernels.attention.paged_attention_reference, for a pool that is
    head-major underneath ([blocks, kv_heads, block_size, dim] contiguous, seen as
    [blocks, block_size, kv_heads, dim]). None when this layout or dtype isn't supported.
    Prompt rows go through it too in tests; the engine sends it decode rows only (see
    kernels/cpu/attention.py for why)."""
    code = _dtype_code(query)
    kv_format = _kv_format(code, query, key_cache, value_cache)
    if kv_format is None or query.stride(2) != 1:
        return None
    if not (_head_major(key_cache) and _head_major(value_cache)):
        return None
    if not (
        block_table.is_contiguous() and cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()
    ):
        return None
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(query.shape)} {query.dtype} tensor")
    if (
        block_table.dtype != torch.int32
        or cu_seqlens_q.dtype != torch.int32
        or seq_lens.dtype != torch.int32
    ):
        return None
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out.zero_()
    if (
        kv_format
    ):  # fp8 pools: the same kernels, each chunk of sequences on widened copies (kv_fp8.cpp)
        if _library.ns_paged_attention_fp8(
            code,
            kv_format,
            out.data_ptr(),
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            num_kv_heads,
            block_size,
            head_dim,
            block_table.data_ptr(),
            block_table.stride(0),
            cu_seqlens_q.data_ptr(),
            seq_lens.data_ptr(),
            num_seqs,
            num_heads,
            float(scale),
            _ROWS_PER_ITEM,
            int(num_tokens == num_seqs and _amx_attention()),
        ):
            return None
        return out
    # Decodes only (one row per sequence: query row i is sequence i's): the AMX decode kernel
    # (kernels/cpu/attention_amx.cpp) where it takes them.
    if (
        num_tokens == num_seqs
        and code == _DTYPES[torch.bfloat16]
        and block_size == 16
        and _amx_attention()
        and _library.ns_decode_attention_amx(
            out.data_ptr(),
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            num_kv_heads,
            head_dim,
            block_table.data_ptr(),
            block_table.stride(0),
            cu_seqlens_q.data_ptr(),
            seq_lens.data_ptr(),
            num_seqs,
            num_heads,
            float(scale),
        )
        == 0
    ):
        return out
    _library.ns_paged_attention(
        code,
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        num_kv_heads,
        block_size,
        head_dim,
        block_table.data_ptr(),
        block_table.stride(0),
        cu_seqlens_q.data_ptr(),
        seq_lens.data_ptr(),
        num_seqs,
        num_heads,
        float(scale),
        _ROWS_PER_ITEM,
    )
    return out


def rms_norm(x, residual, weight, eps):
    """(normed, new_residual) as fused_add_rms_norm_reference (new_residual None without a
    residual); None when unsupported."""
    tensors = (x, weight) if residual is None else (x, residual, weight)
    code = _dtype_code(*tensors)
    if code is None or not (
        x.is_contiguous()
        and weight.is_contiguous()
        and (residual is None or residual.is_contiguous())
    ):
        return None
    hidden = weight.shape[0]
    rows = x.numel() // hidden if hidden else 0
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else None
    if rows:
        _library.ns_rms_norm(
            code,
            out.data_ptr(),
            new_residual.data_ptr() if residual is not None else None,
            x.data_ptr(),
            residual.data_ptr() if residual is not None else None,
            weight.data_ptr(),
            rows,
            hidden,
            float(eps),
        )
    return out, new_residual


def silu_and_mul(gate_up):
    code = _dtype_code(gate_up)
    if code is None or not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        return None
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1] if gate_up.shape[-1] else 0
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    if rows:
        _library.ns_silu_and_mul(code, out.data_ptr(), gate_up.data_ptr(), rows, inter)
    return out


def argmax_rows(x):
    code = _dtype_code(x)
    if code is None or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    if x.shape[0]:
        _library.ns_argmax_rows(
            code, out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0)
        )
    return out


def rotary_store(
    qkv,
    num_heads,
    num_kv_heads,
    head_dim,
    positions,
    cos_sin_cache,
    key_cache,
    value_cache,
    slot_mapping,
) -> bool:
    """Rotary on the q and k heads of the fused QKV rows [tokens, (heads + 2 * kv_heads) * dim],
    in place, then k and v written to the head-major pool at slot_mapping (-1: skipped). As
    apply_rotary_reference followed by store_kvcache_reference. False when unsupported."""
    code = _dtype_code(qkv)
    kv_format = _kv_format(code, qkv, key_cache, value_cache)
    if kv_format is None or qkv.dim() != 2 or qkv.stride(1) != 1 or head_dim % 2:
        return False
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        return False
    if not (_head_major(key_cache) and _head_major(value_cache)):
        return False
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        return False
    if (
        positions.dtype != torch.long
        or slot_mapping.dtype != torch.long
        or not (positions.is_contiguous() and slot_mapping.is_contiguous())
    ):
        return False
    if qkv.shape[0]:
        _library.ns_rotary_store(
            code,
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            cos_sin_cache.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.shape[1],
            slot_mapping.data_ptr(),
            kv_format,
        )
    return True


def prefill_attention(query, key_cache, value_cache, block_table, spans, scale, out) -> bool:
    """Attention of prompt rows (kernels/cpu/attention_amx.cpp): on AMX tiles at the AMX level,
    with VDPBF16PS (or fp32 FMAs where that is slow: bf16_dot_variant) at the AVX-512 BF16 level
    (there 2-4x torch's flash SDPA on a Zen 5 EPYC).
    Spans as cpu_attention.PrefillSpan (their K/V already in the pool), into the rows of `out` (a
    contiguous tensor shaped as query) that the spans cover. Each row's bits depend on that row
    alone, however its prompt is split. False when not taken (then use the SDPA path)."""
    code = _dtype_code(query)
    kv_format = _kv_format(code, query, key_cache, value_cache)
    if not spans or code != _DTYPES[torch.bfloat16] or kv_format is None:
        return False
    if query.stride(2) != 1 or not out.is_contiguous() or key_cache.shape[1] != 16:
        return False
    if not (_head_major(key_cache) and _head_major(value_cache)):
        return False
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        return False
    table = torch.tensor(
        [(s.seq_index, s.row_start, s.q_len, s.seq_len) for s in spans], dtype=torch.int32
    )
    _, num_heads, head_dim = query.shape
    if kv_format:  # fp8 pools: chunks of spans on widened copies (kv_fp8.cpp)
        return (
            _library.ns_prefill_attention_fp8(
                kv_format,
                out.data_ptr(),
                query.data_ptr(),
                query.stride(0),
                query.stride(1),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                key_cache.shape[2],
                head_dim,
                block_table.data_ptr(),
                block_table.stride(0),
                table.data_ptr(),
                len(spans),
                num_heads,
                float(scale),
            )
            == 0
        )
    return (
        _library.ns_prefill_attention(
            out.data_ptr(),
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.shape[2],
            head_dim,
            block_table.data_ptr(),
            block_table.stride(0),
            table.data_ptr(),
            len(spans),
            num_heads,
            float(scale),
        )
        == 0
    )


def decode_layers(
    layer_table,
    addresses,
    rows,
    hidden,
    qkv_n,
    inter,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    scale,
    positions,
    cos_sin_cache,
    metadata,
    kv_format: int = 0,
    lora=None,
) -> int:
    """kernels/cpu/decode_layers.cpp over every layer (models/cpu_decode.py builds the tables):
    the index of the residual among the buffers, 0 when it could not run. `lora`: None, or
    (table, row slots int64, slots, rank, shrink scratch, delta scratch) for a step with LoRA rows."""
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        return 0
    block_table = metadata.block_table
    return _library.ns_decode_layers(
        layer_table.data_ptr(),
        layer_table.shape[0],
        addresses.data_ptr(),
        rows,
        hidden,
        qkv_n,
        inter,
        num_heads,
        num_kv_heads,
        head_dim,
        float(eps),
        float(scale),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        cos_sin_cache.stride(0),
        metadata.slot_mapping.data_ptr(),
        16,
        block_table.data_ptr(),
        block_table.stride(0),
        metadata.cu_seqlens_q.data_ptr(),
        metadata.seq_lens.data_ptr(),
        int(_amx_attention()),
        kv_format,
        *_lora_arguments(lora),
    )


def _lora_arguments(lora) -> tuple:
    if lora is None:
        return None, None, 0, 0, None, None
    table, row_slots, num_slots, rank, shrink, delta = lora
    return (
        table.data_ptr(),
        row_slots.data_ptr(),
        num_slots,
        rank,
        shrink.data_ptr(),
        delta.data_ptr(),
    )


def vnni_gemm_quant() -> bool:
    """Whether the quantized GEMMs run AVX-512 VNNI's vpdpbusd at the current level (which reads a
    5- or 6-bit element as a byte; below it, they are packed in nibbles and bit planes)."""
    lib = library()
    return lib is not None and bool(lib.ns_gemm_quant_vnni())


def _amx_attention() -> bool:
    """attention_amx.cpp's kernels: at the AMX level only (below it ops.cpp's, by level)."""
    return _library.ns_current_isa() == ISA_LEVELS.index("amx")


# ---- row-invariant bf16 GEMM at every ISA level (kernels/cpu/gemm.cpp, gemm_levels.cpp) -----
GEMM_TILE_K = 32  # K must be a multiple of this (AMX's tile depth; one packing serves all levels)
GEMM_TILE_N = 16  # and N of this


def gemm_available() -> bool:
    return available()


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 [N, K] weight in the layout every level of the GEMM reads: per block of 16 output
    columns, its K/2 k-pairs of [16 columns][2] (N padded with zero columns to a multiple of 16;
    grouped here by AMX's tiles of 16 k-pairs, the same bytes). None when the kernels, dtype or
    shape can't take it."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if n == 0 or k == 0 or k % GEMM_TILE_K or not gemm_available():
        return None
    padded = -(-n // GEMM_TILE_N) * GEMM_TILE_N
    weight = weight.detach()
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    blocks = weight.reshape(
        padded // GEMM_TILE_N, GEMM_TILE_N, k // GEMM_TILE_K, GEMM_TILE_K // 2, 2
    )
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


def unpack_gemm_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_gemm_weight's inverse: the bf16 [n, K] weight (for a path that multiplies the weight
    itself, e.g. the torch references, once the packing is the only copy)."""
    groups, k_blocks = packed.shape[0], packed.shape[1]
    return packed.permute(0, 3, 1, 2, 4).reshape(groups * GEMM_TILE_N, k_blocks * GEMM_TILE_K)[:n]


def gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int | None = None
) -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) from pack_gemm_weight's packing of a weight with n rows (all
    of the packed columns by default), at the current ISA level; each row's bits are the same
    whatever M is. None when x can't be taken (then use F.linear)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        return None
    m, k = x.shape
    padded = packed.shape[0] * GEMM_TILE_N
    n = padded if n is None else n
    if k != packed.shape[1] * GEMM_TILE_K or not 0 < n <= padded:
        return None
    if bias is not None:
        if bias.dtype != torch.bfloat16 or bias.shape != (n,):
            return None
        bias = torch.nn.functional.pad(bias, (0, padded - n)) if padded != n else bias.contiguous()
    out = x.new_empty((m, padded))
    code = _library.ns_gemm_bf16(
        out.data_ptr(),
        padded,
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        m,
        padded,
        k,
    )
    if code != 0:
        return None
    return out if padded == n else out[:, :n]


# ---- GEMMs on GGUF block-format weights (kernels/cpu/gemm_quant.cpp; kernels/quant.py) --------


def gemm_quant_many(
    x: torch.Tensor, parts: list[tuple[int, torch.Tensor, int, int, torch.Tensor | None]], n: int
) -> torch.Tensor | None:
    """One call for several GEMMs on row ranges of x [M, K] (bf16 or fp32, contiguous): per part
    (format code, packing, first row, end row, bias [n] or None), out[first:end] = x[first:end] @
    w^T (+ bias), out [M, n] in x.dtype; every weight's n, a multiple of 16, and K. None when
    something can't be taken (then gemm_quant part by part)."""
    code = _dtype_code(x)
    if (
        code is None
        or _library is None
        or x.dim() != 2
        or not x.is_contiguous()
        or n % GEMM_TILE_N
        or not parts
    ):
        return None
    k = x.shape[1]
    out = x.new_empty((x.shape[0], n))
    items = []
    for format_code, packed, first, end, bias in parts:
        if packed.dim() != 3 or packed.shape[0] * GEMM_TILE_N != n or packed.shape[1] != k // 32:
            return None
        if bias is not None and (
            bias.dtype != x.dtype or bias.shape != (n,) or not bias.is_contiguous()
        ):
            return None
        items += [
            format_code,
            packed.data_ptr(),
            x[first].data_ptr() if end > first else 0,
            out[first].data_ptr() if end > first else 0,
            end - first,
            n,
            0 if bias is None else bias.data_ptr(),
        ]
    array = (ctypes.c_int64 * len(items))(*items)
    if _library.ns_gemm_quant_many(len(parts), array, k, code) != 0:
        return None
    return out


def moe_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """kernels/cpu/moe.cpp's router choice on logits [tokens, experts] (fp32 or bf16, rows
    contiguous): (weights fp32 [tokens, top_k], ids int64), or None when it can't take them."""
    code = _dtype_code(logits)
    if (
        code is None
        or logits.dim() != 2
        or logits.stride(1) != 1
        or not 0 < top_k <= logits.shape[1]
    ):
        return None
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=torch.int64)
    if (
        tokens
        and _library.ns_moe_topk(
            code,
            logits.data_ptr(),
            logits.stride(0),
            tokens,
            experts,
            top_k,
            int(renormalize),
            weights.data_ptr(),
            ids.data_ptr(),
        )
        != 0
    ):
        return None
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    table: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inter: int,
) -> torch.Tensor | None:
    """kernels/cpu/moe.cpp: a MoE layer's experts on x [tokens, hidden] (bf16) in one call.
    table int64 [local experts, 4]: (W13's format, its packing's address, W2's format, its
    packing's address), format -1 for pack_gemm_weight's bf16 packing, else quant.format_code;
    topk_ids int64 (local ids, -1 remote) and topk_weights fp32, both [tokens, k]. None when
    something can't be taken (then the grouped path, which gives the same bits)."""
    if (
        library() is None
        or x.dtype != torch.bfloat16
        or x.dim() != 2
        or not x.is_contiguous()
        or topk_ids.dtype != torch.int64
        or topk_weights.dtype != torch.float32
        or topk_ids.shape != topk_weights.shape
        or topk_ids.shape[0] != x.shape[0]
        or table.dtype != torch.int64
        or table.dim() != 2
        or table.shape[1] != 4
    ):
        return None
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    out = torch.empty_like(x)
    scratch = x.new_empty(max(1, tokens * top_k * (2 * hidden + 3 * inter)))
    if (
        _library.ns_moe_experts(
            table.data_ptr(),
            table.shape[0],
            out.data_ptr(),
            x.data_ptr(),
            ids.data_ptr(),
            weights.data_ptr(),
            tokens,
            top_k,
            hidden,
            inter,
            scratch.data_ptr(),
        )
        != 0
    ):
        return None
    return out


def gemm_quant(
    x: torch.Tensor,
    packed: torch.Tensor,
    format_code: int,
    n: int,
    k: int,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """x [M, K] (bf16 or fp32) @ w^T (+ bias) -> [M, n] in x.dtype, w packed by
    quant.pack_weight; format_code is quant.format_code. None when x or bias can't be taken
    (then use quant.reference_gemm, which gives the same bits)."""
    code = _dtype_code(x)
    if code is None or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != k or x.stride(0) < k:
        return None
    padded = packed.shape[0] * GEMM_TILE_N
    if packed.dim() != 3 or packed.shape[1] != k // 32 or not 0 < n <= padded:
        return None
    if bias is not None:
        if bias.dtype != x.dtype or bias.shape != (n,) or not bias.is_cpu:
            return None
        bias = torch.nn.functional.pad(bias, (0, padded - n)) if padded != n else bias.contiguous()
    m = x.shape[0]
    out = x.new_empty((m, padded))
    if (
        _library.ns_gemm_quant(
            format_code,
            out.data_ptr(),
            padded,
            x.data_ptr(),
            x.stride(0),
            code,
            packed.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            m,
            padded,
            k,
        )
        != 0
    ):
        return None
    return out if padded == n else out[:, :n]
