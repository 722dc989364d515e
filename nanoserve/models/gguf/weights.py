"""A GGUF file's tensors into a model built from the config its metadata implies.

Linear layers (and the LM head) keep the file's quantization blocks as they are in
their `weight_form` (kernels/quant.py multiplies them; models/quant_staging.py shards and stages
them); their bf16 `weight` then lives on the meta device and takes no memory. On a CPU the token
embedding stays in the file, mapped (layers/embedding.FileRows: rows read and dequantized as
tokens ask for them); a tied head then takes the tensor as any other layer (its blocks, or a bf16
copy that the CPU GEMM packs), so no module holds a bf16 table beside it. On CUDA the embedding's
blocks are copied to the device as they are (a Triton gather dequantizes the looked-up rows),
shared with a tied head's. Every other tensor (norms, a float or MXFP4 token embedding, linear
weights stored as F32 / F16 / BF16) is dequantized into its parameter in the activation dtype. Shards follow the bf16 loaders (layers/linear.py's
weight_loader, run on the raw block rows): column-parallel layers take whole rows, row-parallel
layers whole blocks of each row.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from nanoserve.distributed.pipeline import is_missing_parameter, missing_prefixes
from nanoserve.kernels import quant
from nanoserve.kernels.cpu.malloc import release_free_memory
from nanoserve.kernels.fused_moe_quant import quantized_expert_form
from nanoserve.layers.cpu_prepack import shared_parameter_ids
from nanoserve.layers.embedding import FileRows, ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.fused_moe import FusedMoE
from nanoserve.layers.linear import LinearBase, load_parameter
from nanoserve.models.gguf.header import VOCABULARY_ARRAYS, read_gguf_header
from nanoserve.models.gguf.reader import (
    ROPE_FACTOR_TENSORS,
    GGUFImportError,
    expert_part,
    hf_tensor_name,
    rotary_rows_permuted,
    tensor_step,
    unpermute_rotary_rows,
)
from nanoserve.models.quant_staging import StagedLinear, finish_quantized, stage_quantized

_FLOAT_TYPES = ("F32", "F16", "BF16")
_ROWS_AT_ONCE = 8192  # vocabulary rows dequantized at a time into an embedding or head parameter


def _qtype(tensor) -> str | None:
    """None for a float tensor; else its kernels/quant.py name (ValueError for unsupported ones,
    naming it and listing the supported)."""
    if tensor.tensor_type.name in _FLOAT_TYPES:
        return None
    try:
        return quant.qtype_name(tensor.tensor_type)
    except ValueError as error:
        raise ValueError(f"{tensor.name}: {error}") from None


def mxfp4_components(raw: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """GGUF MXFP4 rows (uint8 [rows, k / 32 * 17]: per block of 32 an E8M0 exponent byte, then 16
    bytes holding element j in the low nibble of byte j and element j + 16 in its high one) -> the
    kernels' MXFP4 components: the 4-bit codes "u" [rows, k] and "scale" 2^(exponent - 128) [rows,
    k / 32], so that scale * (MXFP4_U[code] - 12) = ggml's value, 2^(e - 128) * 2 * E2M1."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, k // 32, 17)
    quants = blocks[..., 1:]
    codes = torch.cat([quants & 0x0F, quants >> 4], dim=-1).reshape(rows, k)
    scale = torch.ldexp(torch.ones(rows, k // 32), blocks[..., 0].to(torch.int32) - 128)
    return {"u": codes.contiguous(), "scale": scale}


def _row_layout(tensor) -> tuple[int, int]:
    """(rows, bytes a row) of a GGUF tensor as the file stores it."""
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
    return rows, int(tensor.n_bytes) // rows


def _check_row_bytes(tensor, qtype: str, row_bytes: int) -> None:
    """A block type's rows hold whole blocks of the tensor's k values (one-line error else)."""
    block, block_bytes = quant.gguf_block(qtype)
    k = int(tensor.shape[0])
    if row_bytes != k // block * block_bytes or k % block:
        raise GGUFImportError(
            f"{tensor.name}: {row_bytes} bytes a row do not hold {k} {qtype.upper()} values"
        )


def _raw_rows(tensor, gguf_file: Path, rows: slice | None = None) -> torch.Tensor:
    """The tensor's bytes as GGUF stores them: uint8 [rows, row bytes] (`rows`: only these), read
    from the file, not through the reader's memory map, whose pages, once touched, would count as
    this process's memory until the map is closed: the whole file by the end of a load."""
    count, row_bytes = _row_layout(tensor)
    start, stop, _ = (rows or slice(None)).indices(count)
    length = max(stop - start, 0) * row_bytes
    data = np.fromfile(
        gguf_file, dtype=np.uint8, count=length, offset=int(tensor.data_offset) + start * row_bytes
    )
    if data.size != length:
        raise GGUFImportError(f"{tensor.name}: the file ends inside the tensor's data")
    return torch.from_numpy(data.reshape(-1, row_bytes))


def _dense(tensor, qtype: str | None, gguf_file: Path, rows: slice | None = None) -> torch.Tensor:
    """float32, torch's shape (GGUF lists dims fastest first); `rows`: only these rows."""
    import gguf

    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    raw = _raw_rows(tensor, gguf_file, rows)
    if qtype is None or qtype == quant.MXFP4:  # the gguf package's own (exact) dequantization
        values = gguf.quants.dequantize(raw.numpy(), tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1, *shape[1:]))
    return quant.dequantize(raw, qtype, shape[-1])


def _rotary_heads(name: str, config) -> int | None:
    """The heads whose rows to un-permute (None: not a Q/K weight, or a file that keeps HF's order)."""
    if not rotary_rows_permuted(config):
        return None
    if name.endswith("q_proj.weight"):
        return config.num_attention_heads
    if name.endswith("k_proj.weight"):
        return config.num_key_value_heads
    return None


def load_gguf_weights(model: nn.Module, gguf_file: Path, elsewhere: tuple[str, ...] = ()) -> None:
    """Each tensor to its parameter as models/weights.load_weights does (fused parts, pipeline
    stages, the tied head), then each quantized layer's staged parts into its QuantWeight.
    `elsewhere`: prefixes of the parameters another file gives (a LLaVA's mmproj)."""
    # The checked header (models/gguf/header.py), not the gguf package's reader, which trusts the
    # file; the vocabulary's arrays (~200 MiB as Python objects for 128k tokens) checked, not kept.
    header = read_gguf_header(gguf_file, skip=VOCABULARY_ARRAYS)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    missing = missing_prefixes(model)
    tied = bool(model.config.tie_word_embeddings)
    architecture = header.metadata.get("general.architecture")
    tensors = header.tensors
    renames = getattr(
        model, "checkpoint_renames", {}
    )  # gpt-oss's sinks beside its attention kernel
    staged: dict[str, StagedLinear] = {}
    loaded: set[str] = set()
    for tensor in tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:
            continue  # LongRoPE's factors: read into the config (models/gguf/model.py)
        name = hf_tensor_name(tensor.name, architecture)
        for old, new in renames.items():
            name = name.replace(old, new)
        targets = [name]
        if tied and name == "model.embed_tokens.weight" and "lm_head.weight" in params:
            targets.append("lm_head.weight")  # the tied head multiplies the embedding's blocks
        if name == "model.embed_tokens.weight" and _map_embedding(
            modules, params, tensor, gguf_file, missing
        ):
            loaded.add(name)
            targets.remove(name)
        for target in targets:
            if is_missing_parameter(target, missing):
                continue
            shard_id = None
            for fragment, (fused, shard) in packed.items():
                if f".{fragment}." in target:
                    target, shard_id = target.replace(f".{fragment}.", f".{fused}."), shard
                    break
            if target not in params:
                raise GGUFImportError(f"{tensor.name}: no parameter {target!r} in this model")
            module = modules[target.rsplit(".", 1)[0]]
            step = tensor_step(architecture, tensor.name)
            if step is not None:  # the architecture's own values (Gemma's norms)
                _load_stepped(params[target], tensor, gguf_file, step)
                loaded.add(target)
                continue
            stacked, part = expert_part(tensor.name)
            if stacked and tensor.name.endswith(".bias"):
                _load_expert_biases(module, params[target], tensor, part, gguf_file)
            elif stacked:
                _load_experts(module, params[target], tensor, part, gguf_file)
            else:
                parts = staged.setdefault(target, StagedLinear())
                _load_tensor(
                    model.config, module, params[target], tensor, name, shard_id, parts, gguf_file
                )
                if parts.buffers and None not in parts.row_qtype:  # the layer is whole: packed now,
                    _finish_layer(model, module, target, staged.pop(target))  # its staging freed
            loaded.add(target)
    for target, parts in staged.items():
        if parts.buffers:
            _finish_layer(model, modules[target.rsplit(".", 1)[0]], target, parts)
    for module in modules.values():
        if isinstance(module, FusedMoE):  # its quantized experts
            module.finish_quantized()
    if tied:
        _share_tied_rows(modules)
    expected = set(params) - (
        {"lm_head.weight"} if tied and "lm_head.weight" not in loaded else set()
    )
    absent = sorted(name for name in expected - loaded if not name.startswith(elsewhere))
    if absent:
        raise GGUFImportError(f"{gguf_file}: lacks {len(absent)} tensor(s), e.g. {absent[:3]}")


def _finish_layer(model: nn.Module, module: nn.Module, target: str, parts: StagedLinear) -> None:
    """A quantized layer's QuantWeight(s) from its staged parts, packed for the CPU kernels at
    once (a no-op elsewhere), so a load holds one layer's file bytes at a time beside the packed
    model, not the whole file's."""
    shared = id(module.weight) in shared_parameter_ids(
        model
    )  # a tied head (unless the embedding is mapped)
    finish_quantized(module, target, parts, shared)
    module.weight_form.pack_for_cpu_gemm(module.weight)
    release_free_memory()  # the staging, freed into the heap, back to the kernel before the next layer's


def _map_embedding(
    modules: dict[str, nn.Module], params: dict[str, nn.Parameter], tensor, gguf_file: Path, missing
) -> bool:
    """The token embedding as FileRows: on a CPU over its own read-only mapping of the file (not
    the reader's, whose pages the load touches throughout), for a type a lookup dequantizes (not
    MXFP4); held for the Triton kernels (CUDA), this rank's rows of a GGUF block type copied to
    the device as they are (kernels/quant.lookup_rows gathers and dequantizes the rows a step
    asks for; a tied head's blocks then share them, _share_tied_rows). Its bf16 parameter goes to
    the meta device; a tied head keeps its own (unshared) one. False when the table is to be
    loaded as a parameter instead."""
    module = modules.get("model.embed_tokens")
    param = params.get("model.embed_tokens.weight")
    if not isinstance(module, VocabParallelEmbedding) or param is None:
        return False
    if is_missing_parameter("model.embed_tokens.weight", missing):
        return False
    qtype = _qtype(tensor)
    if qtype == quant.MXFP4:
        return False
    k = int(tensor.shape[0])
    rows, row_bytes = _row_layout(tensor)
    if qtype is not None:
        _check_row_bytes(tensor, qtype, row_bytes)
    if not quant.looks_up_file_rows(param.device):
        if qtype is None:  # F32 / F16 / BF16: a parameter in the activations' dtype
            return False
        share = _raw_rows(tensor, gguf_file, slice(module.vocab_start, module.vocab_end))
        module.file_rows = FileRows(share.to(param.device), qtype, None, k)
        module.weight = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False
        )
        return True
    mapped = np.memmap(
        gguf_file, dtype=np.uint8, mode="c", offset=int(tensor.data_offset), shape=(rows, row_bytes)
    )  # copy-on-write: nothing writes it; torch wants it writable
    share = torch.from_numpy(mapped)[module.vocab_start : module.vocab_end]
    file_dtype = (
        None
        if qtype is not None
        else {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[
            tensor.tensor_type.name
        ]
    )
    module.file_rows = FileRows(share, qtype, file_dtype, k)
    module.weight = nn.Parameter(
        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False
    )
    return True


def _share_tied_rows(modules: dict[str, nn.Module]) -> None:
    """A tied head's blocks and the embedding's rows held on the device (_map_embedding) are the
    same bytes: one copy, the embedding's, for both."""
    embedding, head = modules.get("model.embed_tokens"), modules.get("lm_head")
    if not isinstance(embedding, VocabParallelEmbedding) or not isinstance(head, ParallelLMHead):
        return
    rows = embedding.file_rows
    if rows is None or quant.looks_up_file_rows(rows.data.device) or not head.weight_form.quantized:
        return
    parts = head.weight_form.parts
    if len(parts) != 1 or parts[0].raw is None or parts[0].qtype != rows.qtype:
        return
    if parts[0].raw.shape == rows.data.shape and torch.equal(parts[0].raw, rows.data):
        parts[0].raw = rows.data


def _load_experts(
    moe: nn.Module, param: nn.Parameter, tensor, part: int | None, gguf_file: Path
) -> None:
    """A stacked expert tensor (ffn_gate_exps / ffn_up_exps / ffn_down_exps: [experts, outputs,
    inputs]) into layers/fused_moe.FusedMoE, expert by expert (this rank's): each expert's rows
    kept in their blocks where the quantized kernels run (a CPU) and this rank's share of the
    inputs is whole blocks (the down matrix under --tp), else dequantized into the parameter."""
    import gguf

    qtype = _qtype(tensor)
    k = int(tensor.shape[0])
    whole_blocks = qtype is not None and (
        part is not None or moe.expert_parallel or moe.inter % quant.gguf_block(qtype)[0] == 0
    )
    quantized = whole_blocks and quantized_expert_form(param.device, qtype) is not None
    outputs = int(tensor.shape[1])  # rows an expert
    for expert in range(moe.first_expert, moe.first_expert + moe.num_local_experts):
        raw = _raw_rows(tensor, gguf_file, slice(expert * outputs, (expert + 1) * outputs))
        if quantized:
            arrays = mxfp4_components(raw, k) if qtype == quant.MXFP4 else {"raw": raw}
            moe.load_quantized(param, arrays, qtype, (expert, part))
            continue
        if qtype is None or qtype == quant.MXFP4:
            values = torch.from_numpy(
                np.array(
                    gguf.quants.dequantize(raw.numpy(), tensor.tensor_type), dtype=np.float32
                ).reshape(-1, k)
            )
        else:
            values = quant.dequantize(raw, qtype, k)
        moe.weight_loader(param, values, (expert, part))


def _load_stepped(param: nn.Parameter, tensor, gguf_file: Path, step: Callable) -> None:
    """A dense tensor whose values the architecture changes on the way (reader.tensor_step)."""
    param.data.copy_(step(_dense(tensor, None, gguf_file).reshape(param.shape)))


def _load_expert_biases(
    moe: nn.Module, param: nn.Parameter, tensor, part: int | None, gguf_file: Path
) -> None:
    """gpt-oss's stacked expert biases (ffn_gate_exps.bias / ffn_up_exps.bias [experts, inter],
    ffn_down_exps.bias [experts, hidden]) into FusedMoE's w13_bias (gate part, then up part) and
    w2_bias: this rank's experts, and with the intermediate dimension split its share of gate and
    up, the down bias on rank 0 only (as layers/fused_moe.FusedMoE.bias_loader)."""
    values = _dense(tensor, None, gguf_file)
    if part is None:
        FusedMoE.bias_loader(moe, param, values)
        return
    start = 0 if moe.expert_parallel else moe.tp_rank * moe.inter
    rows = values[
        moe.first_expert : moe.first_expert + moe.num_local_experts, start : start + moe.inter
    ]
    param.data[:, part * moe.inter : (part + 1) * moe.inter].copy_(rows)


def _load_tensor(
    config,
    module: nn.Module,
    param: nn.Parameter,
    tensor,
    name: str,
    shard_id,
    parts: StagedLinear,
    gguf_file: Path,
) -> None:
    """A linear layer's (or the head's) quantized part is staged in `parts`; anything else is
    dequantized into `param` (this rank's share of it). `name`: the tensor's HF name."""
    qtype = _qtype(tensor)
    heads = _rotary_heads(name, config)
    quantized_module = isinstance(module, (LinearBase, ParallelLMHead)) and param.dim() == 2
    if qtype == quant.MXFP4 and not quant.linear_keeps_blocks(qtype, param.device):
        qtype = None  # (the Triton kernels have no MXFP4 linear layer): dequantized below
    if qtype is not None and quantized_module:
        if parts.float_parts:
            raise GGUFImportError(f"{tensor.name}: a fused layer mixes float and quantized parts")
        raw = _raw_rows(tensor, gguf_file)
        if heads is not None:
            raw = unpermute_rotary_rows(raw, heads)
        _check_row_bytes(tensor, qtype, raw.shape[1])
        block, k = quant.gguf_block(qtype)[0], int(tensor.shape[0])
        arrays = mxfp4_components(raw, k) if qtype == quant.MXFP4 else {"raw": raw}
        stage_quantized(module, tensor.name, arrays, qtype, block, k, shard_id, parts)
        return
    if parts.buffers and quantized_module:
        raise GGUFImportError(f"{tensor.name}: a fused layer mixes float and quantized parts")
    parts.float_parts += 1
    if isinstance(module, VocabParallelEmbedding):  # the LM head too: this rank's vocabulary rows,
        # a slice at a time (a whole 128k-token table in float32 would be 1 GiB at once)
        for start in range(module.vocab_start, module.vocab_end, _ROWS_AT_ONCE):
            end = min(start + _ROWS_AT_ONCE, module.vocab_end)
            param.data[start - module.vocab_start : end - module.vocab_start].copy_(
                _dense(tensor, qtype, gguf_file, slice(start, end))
            )
        return
    values = _dense(tensor, qtype, gguf_file)
    if heads is not None:
        values = unpermute_rotary_rows(values, heads)
    load_parameter(param, values, shard_id)
