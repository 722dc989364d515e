"""Compile every kernel for a Hopper GPU (sm_90) with Triton's bundled ptxas; no GPU needed.

The interpreter runs code that a GPU rejects, such as a tl.dot tile under 16 or a dtype
mismatch that numpy tolerates. This test catches those on a CPU, for the configurations the
launchers' heuristics actually choose. Compilation must not run under TRITON_INTERPRET=1, so on
a CPU the test runs the compiles in a subprocess without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoserve.kernels import attention, fused_moe, kv_cache, rmsnorm, rotary


def _compile(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int = 2) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.jitted()
    # Unit strides (constexprs) and 16-divisible sizes and pointers, as the JIT specializes them.
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name not in constexprs and not types.get(name, "i32").startswith("fp")
    }
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    if "cubin" not in compiled.asm:
        raise RuntimeError("no cubin produced")
    return f"shared memory {compiled.metadata.shared} B"


ATTENTION_CASES = [  # dtype, group, head_dim, max_seqlen_q, split
    (torch.bfloat16, 4, 128, 1, True),  # decode, split-KV
    (torch.bfloat16, 4, 128, 1, False),
    (torch.bfloat16, 4, 128, 512, False),  # prefill
    (torch.float16, 8, 64, 40, False),
    (torch.float16, 1, 128, 3, False),
    (torch.float32, 3, 128, 33, False),
    (torch.bfloat16, 16, 256, 1, True),
]
FP8_ATTENTION_CASES = [  # an fp8 cache (--kv-cache-dtype): Triton's names for e4m3fn and e5m2
    ("fp8e4nv", torch.bfloat16, 3, 64, 1, True),
    ("fp8e5", torch.bfloat16, 3, 64, 256, False),
    ("fp8e4nv", torch.float16, 4, 128, 40, False),
]
TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _attention(dtype, group, head_dim, max_seqlen_q, split, cache=None):
    padded = max(16, 1 << (head_dim - 1).bit_length())
    block_m, block_n, num_warps, num_stages = attention._choose_tiles(
        torch.device("cuda"), dtype, group, padded, max_seqlen_q
    )
    if min(block_m, block_n, padded) < 16:
        raise ValueError(f"a tl.dot dimension under 16: {block_m}, {block_n}, {padded}")
    name = TYPE_NAMES[dtype]
    types = {p: f"*{name}" for p in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}
    if cache:
        types.update({p: f"*{cache}" for p in ("key_cache_ptr", "value_cache_ptr")})
    types.update(
        {p: "*fp32" for p in ("split_acc_ptr", "split_max_ptr", "split_sum_ptr", "sinks_ptr")}
    )
    types.update({p: "*i32" for p in ("block_table_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr")})
    types["scale_log2"] = "fp32"
    constexprs = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=padded,
        BLOCK_SIZE=16,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // group,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        query_stride_dim=1,
        cache_stride_dim=1,
        out_stride_dim=1,
        KV_FP8=bool(cache),
    )
    return _compile(attention._paged_attention_kernel, types, constexprs, num_warps, num_stages)


def _cases():
    cases = {
        f"attention {TYPE_NAMES[c[0]]} group={c[1]} d={c[2]} q={c[3]} split={c[4]}": (
            lambda c=c: _attention(*c)
        )
        for c in ATTENTION_CASES
    }
    for cache, *case in FP8_ATTENTION_CASES:
        cases[
            f"attention {cache} cache {TYPE_NAMES[case[0]]} group={case[1]} d={case[2]} q={case[3]} "
            f"split={case[4]}"
        ] = lambda cache=cache, case=case: _attention(*case, cache=cache)
    cases["merge splits"] = lambda: _compile(
        attention._merge_splits_kernel,
        {
            "split_acc_ptr": "*fp32",
            "split_max_ptr": "*fp32",
            "split_sum_ptr": "*fp32",
            "out_ptr": "*bf16",
        },
        dict(out_stride_dim=1, HEAD_DIM=128, HEAD_DIM_PADDED=128, SPLITS_PADDED=16),
        4,
    )
    norm_types = {
        p: "*bf16" for p in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "new_residual_ptr")
    }
    norm_types["eps"] = "fp32"
    for has_residual in (True, False):
        cases[f"rms_norm residual={has_residual}"] = lambda r=has_residual: _compile(
            rmsnorm._rms_norm_kernel, norm_types, dict(HAS_RESIDUAL=r, BLOCK=4096), 8
        )
    cases["rotary"] = lambda: _compile(
        rotary._rotary_kernel,
        {"query_ptr": "*bf16", "key_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32"},
        dict(
            query_stride_dim=1,
            key_stride_dim=1,
            HALF=64,
            HALF_PADDED=64,
            HEADS_PADDED=32,
            KV_HEADS_PADDED=8,
        ),
        4,
    )
    kv_cache._bind_helpers()  # as store_kvcache_triton does before its first launch
    for cache, fp8 in (("bf16", (0.0, 0, 0)), ("u8", (448.0, 3, 7)), ("u8", (57344.0, 2, 15))):
        cases[f"store_kvcache {cache} fp8={fp8[1:]}"] = lambda cache=cache, fp8=fp8: _compile(
            kv_cache._store_kvcache_kernel,
            {
                "key_ptr": "*bf16",
                "value_ptr": "*bf16",
                "key_cache_ptr": f"*{cache}",
                "value_cache_ptr": f"*{cache}",
                "slot_mapping_ptr": "*i64",
            },
            dict(
                key_stride_dim=1,
                value_stride_dim=1,
                cache_stride_dim=1,
                BLOCK_SIZE=16,
                HEAD_DIM=128,
                TILE=1024,
                FP8_MAX=fp8[0],
                FP8_MANTISSA=fp8[1],
                FP8_BIAS=fp8[2],
            ),
            4,
        )
    for dtype, block_m in (
        (torch.bfloat16, 16),
        (torch.bfloat16, 64),
        (torch.float32, 16),
    ):  # decode, prefill
        name = TYPE_NAMES[dtype]
        cases[f"fused_moe grouped gemm {name} block_m={block_m}"] = (
            lambda n=name, m=block_m, d=dtype: _compile(
                fused_moe._grouped_gemm_kernel,
                {
                    "a_ptr": f"*{n}",
                    "b_ptr": f"*{n}",
                    "c_ptr": f"*{n}",
                    "sorted_rows_ptr": "*i64",
                    "block_experts_ptr": "*i64",
                },
                dict(
                    BLOCK_M=m,
                    BLOCK_N=fused_moe.BLOCK_N,
                    BLOCK_K=fused_moe.BLOCK_K,
                    DOT_PRECISION="ieee" if d == torch.float32 else "tf32",
                ),
                4,
            )
        )
    return cases


def compile_all() -> int:
    """Prints one line per case; returns the number of failures."""
    failures = 0
    for name, run in _cases().items():
        try:
            print(f"ok   {name}: {run()}", flush=True)
        except Exception as error:  # report every case, not only the first
            failures += 1
            print(f"FAIL {name}: {type(error).__name__}: {error}", flush=True)
    return failures


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile natively")
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert compile_all() == 0
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.kernels.test_compile_sm90 import compile_all; "
            "sys.exit(compile_all())",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "ptxas" in result.stdout + result.stderr and "not found" in result.stdout + result.stderr:
        pytest.skip("Triton's ptxas is not available here")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
