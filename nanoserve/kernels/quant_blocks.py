"""The Triton kernels' form of a weight given as components (kernels/quant.py's QuantComponents:
compressed-tensors', GPTQ's and AWQ's integers, FP8 bytes), held where the Triton kernels run
(CUDA, or the interpreter under NANOSERVE_KERNELS=triton).

The CPU packing repeats every scale once a block of 32 inputs, in fp32: a GPTQ layer with groups of
128 would be 5 bits a weight there against its file's 4.16. Here each scale is kept once per group
of inputs (and once per run of output rows sharing it: an FP8 layer's 128 x 128 blocks, a per-tensor
scale), in fp16 where that holds it exactly (GPTQ's and AWQ's are fp16 in the file), and a Q4_1
layer's min per group as its integer zero point (min = -scale * zero, as every integer checkpoint
makes it), so the weights take about the file's bytes. The groups are found in the values (the
largest run each scale repeats over), so the form is exact whatever the checkpoint's group.

Weight value, element i of output row o, g = i // (32 * group_blocks), r = o // row_group:
  q8_0  scale[r, g] * (u - 128)              qs uint8 [n, k]: u
  q4_0  scale[r, g] * (u - 8)                qs uint8 [n, k / 2]: per block of 32, 16 bytes,
  q4_1  scale[r, g] * (u - zero[o, g])         value j in byte j's low nibble, j + 16 in its high
        or scale[r, g] * u + mins[o, g]        (GGUF's Q4_0 order)
  fp8   scale[r, g] * e4m3(u)                qs uint8 [n, k]: the E4M3 bytes
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
# qtype -> the Triton kernel's FORMAT: 0 a byte an integer, 1 nibbles, 2 E4M3 bytes.
KERNEL_FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 1, "fp8_e4m3": 2}
OFFSETS = {"q8_0": 128, "q4_0": 8, "q4_1": 0, "fp8_e4m3": 0}


@dataclass
class GroupBlocks:
    """One weight in the Triton kernels' component form (see the module's docstring)."""

    qtype: str
    qs: torch.Tensor
    scale: torch.Tensor  # fp16 or fp32 [ceil(n / row_group), groups]
    group_blocks: int  # blocks of 32 inputs a group
    row_group: int  # output rows sharing a scale row (1 unless neither zero nor mins)
    zero: torch.Tensor | None = None  # uint8 [n, groups]
    mins: torch.Tensor | None = None  # fp16 or fp32 [n, groups]

    @property
    def zero_mode(self) -> int:
        """The kernel's ZERO_MODE: 0 the format's offset, 1 zero points, 2 mins."""
        return 1 if self.zero is not None else (2 if self.mins is not None else 0)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.qs, self.scale, self.zero, self.mins)
            if t is not None
        )

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def to(self, device: torch.device) -> GroupBlocks:
        def moved(t):
            return None if t is None else t.to(device)

        return GroupBlocks(
            self.qtype,
            self.qs.to(device),
            self.scale.to(device),
            self.group_blocks,
            self.row_group,
            moved(self.zero),
            moved(self.mins),
        )


def _runs(values: list[torch.Tensor], size: int, dim: int) -> int:
    """The largest run r (the whole `size`, else a power of two) along `dim` over which every
    tensor in `values` repeats each value (the last run may be shorter): 1 at least."""
    candidates = [size] + [1 << p for p in range(size.bit_length() - 1, 0, -1) if 1 << p < size]
    for run in candidates:
        if all(torch.equal(t, t.index_select(dim, _starts(size, run, t.device))) for t in values):
            return run
    return 1


def _starts(size: int, run: int, device: torch.device) -> torch.Tensor:
    """Index i -> the first index of its run."""
    return torch.arange(size, device=device) // run * run


def _compact(t: torch.Tensor, run: int, dim: int) -> torch.Tensor:
    return t.index_select(dim, torch.arange(0, t.shape[dim], run, device=t.device)).contiguous()


def _narrowest(t: torch.Tensor) -> torch.Tensor:
    """fp16 where it holds every value exactly, else fp32."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t.float().contiguous()


def _zero_points(scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor | None:
    """uint8 z with mins = -(scale * z) exactly (an integer checkpoint's zero points), else None."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    z = torch.round(-mins / safe).clamp(0, 255)
    if not torch.equal(-(scale * z), mins):
        return None
    return z.to(torch.uint8).contiguous()


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] of values 0..15 -> [n, k / 2]: per block of 32, value j low, j + 16 high."""
    n, k = u.shape
    blocks = u.reshape(n, k // BLOCK, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    blocks = qs.reshape(n, -1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, -1)


def make_group_blocks(
    qtype: str, u: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None
) -> GroupBlocks:
    """The component form of u uint8 [n, k], scale fp32 [n, k / 32] (a scale per block of 32),
    mins fp32 [n, k / 32] or None (q4_1 only)."""
    if qtype not in KERNEL_FORMATS:
        raise ValueError(
            f"no Triton component form for {qtype!r} (have {', '.join(KERNEL_FORMATS)})"
        )
    n, blocks = scale.shape
    scale = scale.float()
    along_k = [scale] + ([] if mins is None else [mins.float()])
    group = _runs(along_k, blocks, 1)
    scale = _compact(scale, group, 1)
    qs = pack_nibbles(u) if KERNEL_FORMATS[qtype] == 1 else u.contiguous()
    if mins is not None:
        mins = _compact(mins.float(), group, 1)
        zero = _zero_points(scale, mins)
        if zero is not None:
            return GroupBlocks(qtype, qs, _narrowest(scale), group, 1, zero=zero)
        return GroupBlocks(qtype, qs, _narrowest(scale), group, 1, mins=_narrowest(mins))
    row_group = _runs([scale], n, 0)
    return GroupBlocks(qtype, qs, _narrowest(_compact(scale, row_group, 0)), group, row_group)


def group_blocks_components(
    blocks: GroupBlocks, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """make_group_blocks' inverse: (u uint8 [n, k], scale fp32 [n, k / 32], mins fp32 or None),
    the values of the weight (a zero point's min computed as the kernel's scale * (u - zero) is
    not: reference and kernel differ there by a rounding)."""
    nb = k // BLOCK
    u = unpack_nibbles(blocks.qs) if KERNEL_FORMATS[blocks.qtype] == 1 else blocks.qs
    scale = blocks.scale.float().repeat_interleave(blocks.row_group, dim=0)[:n]
    scale = scale.repeat_interleave(blocks.group_blocks, dim=1)[:, :nb].contiguous()
    mins = None
    if blocks.zero is not None:
        zero = blocks.zero.float().repeat_interleave(blocks.group_blocks, dim=1)[:, :nb]
        mins = -(scale * zero)
    elif blocks.mins is not None:
        mins = blocks.mins.float().repeat_interleave(blocks.group_blocks, dim=1)[:, :nb]
    return u.contiguous(), scale, None if mins is None else mins.contiguous()


def dequantize_group_blocks(blocks: GroupBlocks, n: int, k: int) -> torch.Tensor:
    """float32 [n, k]: the weight by the formula in the module's docstring (the kernels' oracle)."""
    u = unpack_nibbles(blocks.qs) if KERNEL_FORMATS[blocks.qtype] == 1 else blocks.qs
    u = u.cpu()
    inputs = BLOCK * blocks.group_blocks

    def per_input(t: torch.Tensor, row_run: int) -> torch.Tensor:
        return (
            t.cpu()
            .float()
            .repeat_interleave(row_run, dim=0)[:n]
            .repeat_interleave(inputs, dim=1)[:, :k]
        )

    scale = per_input(blocks.scale, blocks.row_group)
    if blocks.qtype == "fp8_e4m3":
        return scale * u.contiguous().view(torch.float8_e4m3fn).float()
    if blocks.zero is not None:
        return scale * (u.float() - per_input(blocks.zero, 1))
    if blocks.mins is not None:
        return scale * u.float() + per_input(blocks.mins, 1)
    return scale * (u.float() - OFFSETS[blocks.qtype])
