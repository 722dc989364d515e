"""Mixture-of-experts: the router's top-k and the experts as one operation (vLLM's fused_moe).

The experts' weights are stacked: w13 [experts, 2 * inter, hidden] (gate rows then up rows, as
one SiLU x mul input) and w2 [experts, hidden, inter]. Three implementations of `fused_experts`
with one signature:

- `fused_experts_reference`: a loop over experts, each taking the tokens that picked it (as
  transformers does); the oracle.
- `fused_experts_grouped`: the (token, slot) rows sorted by expert (`moe_align`, as vLLM's
  moe_align_block_size without the padding), one GEMM per expert over its rows for gate/up, SiLU x
  mul, one for down, and the top-k results summed per token in slot order in fp32. On CPU in bf16
  each GEMM is kernels/cpu/gemm*.cpp on weights packed once (`pack_expert_weights`), whose rows
  are invariant to M, and the sum is elementwise: a token's bits do not depend on its batch.
- `fused_experts_triton`: the same grouping for CUDA, each expert's rows padded to whole blocks
  (`moe_align_block_size`, every size fixed by the number of rows, experts and BLOCK_M, never
  read back from the GPU, so a decode step can be captured in a CUDA graph), a block of rows
  multiplying one expert's matrix: two launches of `_grouped_gemm_kernel` (gate/up from the
  token rows, down from the SiLU x mul rows), then the same fp32 top-k sum. Quantized experts
  stay in their blocks there (kernels/fused_moe_quant.py's ExpertBlocks), dequantized in
  registers by the same grouping's kernel.

Expert parallelism: `topk_ids` holds local expert indices, -1 for experts on other ranks; those
slots contribute nothing here (their rank adds them in the all-reduce).

`bias`: None, or (b13 [experts, 2 * inter], b2 [experts, hidden]) added to each expert's gate/up
and down outputs. `packed`: (packed13, packed2), each the stacked bf16 packings of
`pack_expert_weights` or a list of kernels/quant.py QuantWeights, one per expert (a quantized
checkpoint's experts, kept in a kernel format on the CPU: the grouped path multiplies them with
quant_gemm, whose rows are invariant to the batch too; the loop reads them dequantized), or an
ExpertBlocks (a quantized checkpoint's experts on CUDA: the Triton path multiplies them).
`activation`: what turns a gate/up row into the down GEMM's input (SiLU x mul unless a family
says otherwise: gpt-oss's `swiglu_oai`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.kernels import quant, silu_and_mul
from nanoserve.kernels.choice import kernel_choice
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.fused_moe_quant import ExpertBlocks, quant_grouped_gemm
from nanoserve.kernels.gemm import gemm_packing, unquantized_gemm
from nanoserve.kernels.triton_utils import cdiv, check_triton_device, lazy_jit

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)
BLOCK_N, BLOCK_K = 64, 32  # the grouped GEMM's output columns and depth per step (BLOCK_M: by rows)


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top_k largest in descending order, renormalised to
    sum to 1 when asked (Mixtral always; Qwen-MoE / OLMoE as their config's norm_topk_prob says).
    Returns (weights fp32 [tokens, k], expert ids int64). On CPU kernels/cpu/moe.cpp's
    ns_moe_topk (arithmetic of our own, which the fused decode step shares:
    models/cpu_decode.py), else fused_topk_reference."""
    if router_logits.dim() != 2 or not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(
            f"router logits [tokens, experts] with top_k in 1..experts, got "
            f"{tuple(router_logits.shape)} and top_k {top_k}"
        )
    if not router_logits.is_cuda and cpu_ops.available():
        done = cpu_ops.moe_topk(router_logits, top_k, renormalize)
        if done is not None:
            return done
    return fused_topk_reference(router_logits, top_k, renormalize)


def fused_topk_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_topk in torch (torch.topk, as transformers)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_align(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flattened (token, slot) rows sorted by expert, stably (a token's rows keep their
    order): `sorted_rows` [tokens * k] indexes topk_ids.reshape(-1); expert e's rows are
    sorted_rows[offsets[e] : offsets[e + 1]] (offsets [experts + 1]). Rows of id -1 (experts
    on other ranks) sort first, before offsets[0]."""
    flat = topk_ids.reshape(-1)
    sorted_rows = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=num_experts + 1)
    return sorted_rows, torch.cumsum(counts, 0)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of [rows, 2 * inter] (gate columns, then up): the gate clamped
    from above and the up part to +-limit, then (up + 1) * gate * sigmoid(alpha * gate). In fp32,
    rounded once to the input's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return ((up + 1.0) * gate * torch.sigmoid(gate * alpha)).to(gate_up.dtype)


def check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"hidden [tokens, hidden], w13 [experts, 2 * inter, hidden], w2 [experts, hidden, inter]; "
            f"got {tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    experts, two_inter, size = w13.shape
    if size != hidden.shape[1] or w2.shape != (experts, size, two_inter // 2) or two_inter % 2:
        raise ValueError(
            f"expert weights do not fit hidden size {hidden.shape[1]}: w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if (
        topk_ids.shape != topk_weights.shape
        or topk_ids.dim() != 2
        or topk_ids.shape[0] != hidden.shape[0]
    ):
        raise ValueError(
            f"topk_ids and topk_weights must both be [tokens, k], got {tuple(topk_ids.shape)} "
            f"and {tuple(topk_weights.shape)} for {hidden.shape[0]} tokens"
        )


def fused_experts_reference(
    hidden, w13, w2, topk_weights, topk_ids, packed=None, bias=None, activation=None
) -> torch.Tensor:
    """The oracle: expert by expert, the tokens that picked it, weighted and added in fp32."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    activation = activation or silu_and_mul
    b13, b2 = bias if bias is not None else (None, None)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate_up = F.linear(hidden[token], w13[expert], None if b13 is None else b13[expert])
        expert_out = F.linear(activation(gate_up), w2[expert], None if b2 is None else b2[expert])
        out.index_add_(0, token, expert_out.float() * topk_weights[token, slot, None])
    return out.to(hidden.dtype)


def pack_expert_weights(weights: torch.Tensor) -> torch.Tensor | None:
    """Each expert's [N, K] matrix in kernels/cpu/gemm.cpp's packing, stacked (expert e's at
    [e]); None when the GEMM can't take them (not bf16 on CPU, K not a multiple of 32, or
    NANOSERVE_CPU_GEMM=onednn: kernels/gemm.gemm_packing decides)."""
    packed = [gemm_packing(weights[e]) for e in range(weights.shape[0])]
    if not packed or any(p is None for p in packed):
        return None
    return torch.stack(packed)


def _expert_linear(
    x: torch.Tensor, weight: torch.Tensor, packed, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """One expert's matrix as a linear layer's: `packed` a QuantWeight (a quantized expert):
    kernels/quant.quant_gemm; else our GEMM on its packing (the only copy once
    FusedMoE.prepack_gemm packed it), else F.linear."""
    if isinstance(packed, quant.QuantWeight):
        return quant.quant_gemm(x, packed, bias).contiguous()
    return unquantized_gemm(x, weight, bias, packed).contiguous()


def unpacked_experts(weights: torch.Tensor, packed) -> torch.Tensor:
    """The experts' float matrices, read back from their packing (or, quantized experts: their
    QuantWeights dequantized) when that is the only copy (the parameters are on the meta device);
    `weights` as they are else."""
    if not weights.is_meta or packed is None:
        return weights
    if isinstance(packed, ExpertBlocks):  # quantized experts held for the Triton kernel
        return packed.dequantized(weights.dtype).to(packed.device)
    if isinstance(packed, (list, tuple)):
        return torch.stack([quant.dequantize_weight(w) for w in packed]).to(weights.dtype)
    return torch.stack(
        [cpu_ops.unpack_gemm_weight(packed[e], weights.shape[1]) for e in range(weights.shape[0])]
    )


def combine_topk(
    expert_rows: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """sum_j weight[t, j] * rows[t, j] in fp32, slot by slot: elementwise, so a token's sum is
    the same whatever the number of tokens. expert_rows [tokens, k, hidden]."""
    out = expert_rows[:, 0].float() * topk_weights[:, :1]
    for slot in range(1, topk_weights.shape[1]):
        out += expert_rows[:, slot].float() * topk_weights[:, slot : slot + 1]
    return out.to(dtype)


def fused_experts_grouped(
    hidden, w13, w2, topk_weights, topk_ids, packed=None, bias=None, activation=None
) -> torch.Tensor:
    """Rows grouped by expert: one gather of every local row in expert order, one gate/up GEMM
    and one down GEMM per expert that has rows (each on a contiguous run of the gathered rows),
    SiLU x mul and the scatter back once for all. `packed`: (pack_expert_weights(w13),
    pack_expert_weights(w2)) or None."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    expert_rows = hidden.new_zeros(
        (tokens * top_k, hidden.shape[1])
    )  # rows of remote experts stay zero
    sorted_rows, offsets = moe_align(topk_ids, w13.shape[0])
    bounds = offsets.tolist()
    local_rows = sorted_rows[bounds[0] :]
    spans = [
        (e, bounds[e] - bounds[0], bounds[e + 1] - bounds[0])
        for e in range(w13.shape[0])
        if bounds[e + 1] > bounds[e]
    ]
    if not spans:
        return combine_topk(
            expert_rows.view(tokens, top_k, hidden.shape[1]), topk_weights, hidden.dtype
        )
    packed13, packed2 = packed if packed is not None else (None, None)
    b13, b2 = bias if bias is not None else (None, None)
    part = lambda tensors, e: None if tensors is None else tensors[e]  # noqa: E731
    x = hidden[local_rows // top_k]

    def linear(rows, weights, packings, biases):
        if isinstance(
            part(packings, spans[0][0]), quant.QuantWeight
        ):  # quantized: every expert's GEMM in one call
            out = quant.quant_gemm_many(
                rows,
                [packings[e] for e, _, _ in spans],
                [(start, end) for _, start, end in spans],
                [part(biases, e) for e, _, _ in spans],
            )
            if out is not None:
                return out
        return torch.cat(
            [
                _expert_linear(rows[start:end], weights[e], part(packings, e), part(biases, e))
                for e, start, end in spans
            ]
        )

    act = (activation or silu_and_mul)(linear(x, w13, packed13, b13))
    expert_rows[local_rows] = linear(act, w2, packed2, b2)
    return combine_topk(
        expert_rows.view(tokens, top_k, hidden.shape[1]), topk_weights, hidden.dtype
    )


def cpu_expert_table(w13: torch.Tensor, w2: torch.Tensor, packed) -> torch.Tensor | None:
    """kernels/cpu/moe.cpp's view of the experts: int64 [local experts, 4], per expert (W13's
    format, its packing's address, W2's format, its packing's address); format -1 for the bf16
    packing (pack_expert_weights), else the quantized kernel format (quant.format_code). None
    unless every expert's two matrices are packed for the CPU kernels with their columns in whole
    tiles of 16 (then the grouped path). The addresses are the packings' own: the caller keeps
    them alive (FusedMoE holds both)."""
    if packed is None or not cpu_ops.available():
        return None
    experts, two_inter, hidden = w13.shape
    rows = [[0, 0, 0, 0] for _ in range(experts)]
    for column, packings, n, k in (
        (0, packed[0], two_inter, hidden),
        (2, packed[1], hidden, two_inter // 2),
    ):
        if n % 16 or k % 32:
            return None
        if isinstance(packings, (list, tuple)):  # quantized experts: one QuantWeight each
            if len(packings) != experts:
                return None
            for e, weight in enumerate(packings):
                if (
                    not isinstance(weight, quant.QuantWeight)
                    or weight.packed is None
                    or weight.n != n
                    or weight.k != k
                    or weight.packed.device.type != "cpu"
                    or weight.packed.shape[0] * 16 != n
                    or weight.packed.shape[1] != k // 32
                ):
                    return None
                rows[e][column : column + 2] = [weight.kernel_format, weight.packed.data_ptr()]
        elif isinstance(packings, torch.Tensor):  # the bf16 packings, stacked
            if (
                packings.device.type != "cpu"
                or packings.shape[0] != experts
                or packings.shape[1] * 16 != n
                or packings.shape[2] * 32 != k
            ):
                return None
            for e in range(experts):
                rows[e][column : column + 2] = [-1, packings[e].data_ptr()]
        else:
            return None
    return torch.tensor(rows, dtype=torch.int64)


@lazy_jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_rows_ptr,
    block_experts_ptr,
    n,
    k,
    num_rows,
    a_rows_per_row,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # c[row] = a[row // a_rows_per_row] @ b[expert].T for the BLOCK_M sorted rows of this
    # program's block (all of one expert) and BLOCK_N output columns. Padding rows (>= num_rows)
    # and blocks past the last expert's (expert id num_experts) are skipped.
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    a_rows = rows // a_rows_per_row
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_mask = (k0 + depth) < k
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + depth)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr
            + expert * stride_be
            + cols[None, :] * stride_bn
            + (k0 + depth)[:, None] * stride_bk,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_experts): sorted_rows [max_rows] holds the flattened (token, slot) row
    indices expert by expert, each expert's run padded to a multiple of block_m with the
    sentinel tokens * k; block_experts [max_rows / block_m] the expert of each block
    (num_experts past the end, and for rows of id -1, experts on other ranks). max_rows is
    the bound rows + (experts + 1) * (block_m - 1), so no size depends on the routing."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    bucket = torch.where(flat < 0, num_experts, flat)  # remote experts: the last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank_in_bucket = (
        torch.arange(num_rows, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[sorted_bucket]
    )
    max_rows = cdiv(num_rows + (num_experts + 1) * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((max_rows,), num_rows, dtype=torch.int64, device=flat.device)
    sorted_rows[(padded_ends - padded)[sorted_bucket] + rank_in_bucket] = order
    block_starts = torch.arange(0, max_rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(
        padded_ends, block_starts, right=True
    )  # num_experts (+1) past the end
    return sorted_rows, torch.clamp(block_experts, max=num_experts)


def _launch(a, weights, out, sorted_rows, block_experts, a_rows_per_row, block_m) -> None:
    """One grouped GEMM: `weights` the float matrices [experts, n, k] or an ExpertBlocks
    (quantized experts, kernels/fused_moe_quant.py)."""
    if isinstance(weights, ExpertBlocks):
        quant_grouped_gemm(a, weights, out, sorted_rows, block_experts, a_rows_per_row, block_m)
        return
    check_triton_device(a, weights)
    if weights.stride(2) != 1:
        raise ValueError("the expert weights must be contiguous in their last dimension")
    num_experts, n, k = weights.shape
    grid = (block_experts.shape[0], cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a,
        weights,
        out,
        sorted_rows,
        block_experts,
        n,
        k,
        out.shape[0],
        a_rows_per_row,
        a.stride(0),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        out.stride(0),
        num_experts,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def _add_expert_bias_(
    rows: torch.Tensor, bias: torch.Tensor | None, topk_ids: torch.Tensor
) -> None:
    """rows [tokens * k, n] in (token, slot) order += their expert's bias row (none for slots of
    experts on other ranks, id -1)."""
    if bias is None:
        return
    ids = topk_ids.reshape(-1)
    rows += torch.where((ids >= 0)[:, None], bias[ids.clamp(min=0)], 0).to(rows.dtype)


def _matrix_shape(weights) -> tuple[int, int, int]:
    """(experts, n, k) of float matrices or an ExpertBlocks."""
    if isinstance(weights, ExpertBlocks):
        return weights.num_experts, weights.n, weights.k
    return tuple(weights.shape)


def fused_experts_triton(
    hidden, w13, w2, topk_weights, topk_ids, packed=None, bias=None, activation=None
) -> torch.Tensor:
    """As kernels/fused_moe.fused_experts_reference, with the grouped GEMMs in Triton. `packed`:
    None, or (w13's, w2's) ExpertBlocks or None each: a matrix held quantized is multiplied
    from its blocks (its parameter may be on the meta device)."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    check_triton_device(hidden, topk_weights, topk_ids)
    if hidden.stride(1) != 1:
        raise ValueError("hidden must be contiguous in its last dimension")
    packed13, packed2 = packed if packed is not None else (None, None)
    w13 = packed13 if isinstance(packed13, ExpertBlocks) else w13
    w2 = packed2 if isinstance(packed2, ExpertBlocks) else w2
    tokens, top_k = topk_ids.shape
    num_experts, two_inter, size = _matrix_shape(w13)
    # tl.dot needs >= 16 rows. Few rows per expert (decode): 16, little padding; many
    # (prefill): 64, each expert's matrix tile read once for more rows.
    block_m = 16 if tokens * top_k <= 32 * num_experts else 64
    sorted_rows, block_experts = moe_align_block_size(topk_ids, num_experts, block_m)
    gate_up = torch.empty((tokens * top_k, two_inter), dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, gate_up, sorted_rows, block_experts, top_k, block_m)
    b13, b2 = bias if bias is not None else (None, None)
    _add_expert_bias_(gate_up, b13, topk_ids)
    act = (activation or silu_and_mul)(gate_up)
    expert_rows = torch.zeros((tokens * top_k, size), dtype=hidden.dtype, device=hidden.device)
    _launch(act, w2, expert_rows, sorted_rows, block_experts, 1, block_m)
    _add_expert_bias_(expert_rows, b2, topk_ids)
    return combine_topk(
        expert_rows.view(tokens, top_k, hidden.shape[1]), topk_weights, hidden.dtype
    )


def fused_experts(
    hidden,
    w13,
    w2,
    topk_weights,
    topk_ids,
    packed=None,
    bias=None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch (see kernels/__init__.py): Triton on CUDA (or NANOSERVE_KERNELS=triton), the
    loop under NANOSERVE_KERNELS=reference, on CPU the grouped path in one C++ call when `table`
    (cpu_expert_table of `packed`) is given and it can take the layer, else the grouped path."""
    choice = kernel_choice()
    if (
        table is not None
        and choice not in ("reference", "triton")
        and not hidden.is_cuda
        and bias is None
        and activation is None
    ):
        # kernels/cpu/moe.cpp: the grouped path's arithmetic in one C++ call, the same bits
        # (SiLU x mul, no biases, bf16 activations; None: it can't take them).
        out = cpu_ops.moe_experts(hidden, table, topk_ids, topk_weights, w13.shape[1] // 2)
        if out is not None:
            return out
    packed13, packed2 = packed if packed is not None else (None, None)
    blocks = isinstance(packed13, ExpertBlocks) or isinstance(packed2, ExpertBlocks)
    if choice == "reference":
        w13, w2 = unpacked_experts(w13, packed13), unpacked_experts(w2, packed2)
        return fused_experts_reference(
            hidden, w13, w2, topk_weights, topk_ids, None, bias, activation
        )
    if choice == "triton" or hidden.is_cuda or blocks:
        # Experts held in blocks for the Triton kernel (kernels/fused_moe_quant.py) stay so;
        # other packings are read back as float matrices.
        if not isinstance(packed13, ExpertBlocks):
            w13, packed13 = unpacked_experts(w13, packed13), None
        if not isinstance(packed2, ExpertBlocks):
            w2, packed2 = unpacked_experts(w2, packed2), None
        return fused_experts_triton(
            hidden, w13, w2, topk_weights, topk_ids, (packed13, packed2), bias, activation
        )
    return fused_experts_grouped(hidden, w13, w2, topk_weights, topk_ids, packed, bias, activation)


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_map: torch.Tensor | None = None,
    packed=None,
    bias=None,
    activation=None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router top-k then the experts. `expert_map` [global experts]: local index or -1 (expert
    parallelism); None: every expert is local. This rank's part of the output (the caller
    all-reduces across tensor-parallel ranks). `table`: see fused_experts."""
    topk_weights, topk_ids = fused_topk(router_logits, top_k, renormalize)
    if expert_map is not None:
        topk_ids = expert_map[topk_ids]
    return fused_experts(hidden, w13, w2, topk_weights, topk_ids, packed, bias, activation, table)
