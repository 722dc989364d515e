"""Turns a scheduled batch into tensors (token ids, positions, block tables, slot mapping),
runs the model once for the whole batch, and samples. Sizing and allocating the KV cache is in
engine/kv_allocation.py; the step's wire format for the other ranks in engine/model_input.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nanoserve import kernels
from nanoserve.config import EngineConfig
from nanoserve.distributed import get_pp_world_size, get_rank, get_world_size
from nanoserve.distributed.rank import resolve_device_type
from nanoserve.engine.cuda_graphs import CaptureStats, DecodeGraphs
from nanoserve.engine.encoder_input import encoder_model_input
from nanoserve.engine.gpu_memory import MemoryAtStart
from nanoserve.engine.image_broadcast import gather_image_embeds, receive_values, send_values
from nanoserve.engine.image_step import EncoderCache, embed_with_images
from nanoserve.engine.kv_allocation import KVCacheAllocation
from nanoserve.engine.model_input import (
    LoRAHeader,
    ModelInput,
    StopHeader,
    SwapHeader,
    broadcast_stop,
    empty_header,
    pack_lora,
    pack_step,
    pack_swap,
    prefill_row_tile,
    read_header,
    unpack_lora,
    unpack_step,
    unpack_swap,
)
from nanoserve.engine.pipeline_stage import PipelineStage
from nanoserve.engine.spec_decode.verify import verify
from nanoserve.engine.step_input import PLACEHOLDER_TOKEN, ImageSlice, PreviousTokens, SeqInput
from nanoserve.engine.swap import SwapPlan
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.cpu.malloc import keep_freed_memory, release_free_memory
from nanoserve.kernels.cpu.threads import threads_per_rank
from nanoserve.kernels.kv_dtype import cache_dtype
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.cpu_prepack import prepack_gemm_weights, prepack_linear_weights
from nanoserve.layers.sampler import (
    LogprobsTensors,
    SamplerOutput,
    SamplingBatch,
    gather_logprobs,
    sample,
)
from nanoserve.lora.layers import lora_batch
from nanoserve.lora.manager import LoRAManager
from nanoserve.models.config import ModelConfig
from nanoserve.models.cpu_decode import FusedDecode
from nanoserve.models.registry import build_model, model_pooling_tasks, model_weight_bytes

logger = logging.getLogger(__name__)


class ModelRunner(KVCacheAllocation):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: Path,
        device: torch.device | None = None,
    ):
        self.config = config
        self.model_config = model_config
        self.device = device if device is not None else torch.device(resolve_device_type(config))
        self.rank = get_rank()  # among every rank (tp x pp)
        self.world_size = get_world_size()
        if self.device.type == "cpu":
            keep_freed_memory()
            if self.world_size == 1:  # TP ranks are sized by init_rank
                torch.set_num_threads(threads_per_rank(config.cpu_threads))
        self.dtype = model_config.resolve_dtype(config.dtype)
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)  # the KV pool's elements
        # A pooling model (--runner pooling): forward returns the final hidden states of every
        # row, no logits (the engine pools them); it never decodes.
        self.pooling = config.resolve_runner(model_config.pooling_only) == "pooling"
        # An encoder (models/bert.py): whole prompts, bidirectional, no KV cache at all.
        self.encoder = model_config.encoder is not None
        self.block_size = config.block_size
        self.memory_at_start = (
            MemoryAtStart.take(self.device) if self.device.type == "cuda" else None
        )
        self.memory_profile: dict[str, int] | None = None  # CUDA: how the KV pool was sized (bytes)
        self.model = build_model(
            model_config,
            self.dtype,
            self.device,
            model_dir,
            config.max_model_len or model_config.max_position_embeddings,
            enable_expert_parallel=config.enable_expert_parallel,
            quantization=config.quantization,
        )
        # Prompt rows are padded to PREFILL_ROW_TILE on CPU unless every linear layer multiplies
        # through kernels/cpu/gemm*.cpp, whose rows are invariant to M without padding.
        self.pad_prompt_rows = False
        if self.device.type == "cpu":
            if self.rank == 0:
                logger.info(cpu_ops.describe_isa())
            packed, slots = prepack_gemm_weights(self.model)
            self.pad_prompt_rows = packed < slots
            prepack_linear_weights(self.model, batch_size_hint=min(config.max_num_seqs, 64))
            release_free_memory()  # the load's staging buffers
        # --enable-lora: the adapters this rank holds and the layers' slots (lora/manager.py).
        self.lora: LoRAManager | None = None
        if config.enable_lora and not self.pooling:
            self.lora = LoRAManager(
                self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device
            )
            if self.device.type == "cpu" and not self.lora.all_on_cpu_gemm:
                self.pad_prompt_rows = (
                    True  # the LoRA GEMMs' rows are invariant in whole tiles only
                )
        # A sequence classifier's head, run by the pooling step on its pooled rows.
        self.classifier_head = (
            self.model.classify if "classify" in model_pooling_tasks(model_config) else None
        )
        # Vision-language models: image embeddings by image hash (engine/image_step.py), on rank
        # 0 only, which runs the encoder (engine/image_broadcast.py).
        self.encoder_cache = (
            EncoderCache(self.model.embed_image_list, self.device)
            if model_config.vision is not None and self.rank == 0
            else None
        )
        self.weight_bytes = model_weight_bytes(self.model)
        self.rank_weight_bytes = [self.weight_bytes]
        self.broadcast_seconds = 0.0
        self.broadcast_steps = 0
        self.num_swap_blocks = 0  # host blocks for swapped-out sequences (preemption mode "swap")
        self.num_kv_blocks = 0 if self.encoder else self._allocate_kv_cache()
        # Pipeline parallelism: this rank's stage (engine/pipeline_stage.py); None with one stage.
        self.pipeline = PipelineStage(self) if get_pp_world_size() > 1 else None
        self.swapper = None if self.encoder else self._allocate_host_pool()
        self.max_model_len = self._max_model_len()
        # CPU: steps of decodes only run their decoder layers in one C++ call (models/cpu_decode.py).
        self.fused_decode = (
            FusedDecode.build(self.model, self.world_size)
            if self.device.type == "cpu" and not self.pooling
            else None
        )
        self.decode_graphs: DecodeGraphs | None = None
        self.graph_capture: CaptureStats | None = None
        if self.device.type == "cuda" and not config.enforce_eager and not self.pooling:
            if self.world_size > 1:
                logger.info(
                    "CUDA graphs are off with tensor or pipeline parallelism: every step runs eagerly"
                )
            elif not kernels.graph_safe(self.device):
                logger.info(
                    "CUDA graphs are off with NANOSERVE_KERNELS=reference (the torch "
                    "references sync with the host): every step runs eagerly"
                )
            else:
                self.decode_graphs = self.make_decode_graphs()
                self.graph_capture = self.decode_graphs.capture()

    def _max_model_len(self) -> int:
        """The longest sequence a step can hold (the engine lowers its limit the same way)."""
        longest = self.config.max_model_len or self.model_config.max_position_embeddings
        if self.encoder:
            return longest
        return min(longest, self.num_kv_blocks * self.block_size)

    def make_decode_graphs(self, capture: bool | None = None) -> DecodeGraphs:
        """Static decode buffers for this runner's model (captured as CUDA graphs on CUDA,
        unless ``capture=False``). Decode batches never exceed max_num_batched_tokens either."""
        max_batch = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        return DecodeGraphs(
            self.model,
            self.device,
            max_batch,
            self.max_model_len,
            self.block_size,
            prefill_row_tile(self.device),
            capture=capture,
        )

    def swap(self, plan: SwapPlan) -> None:
        """Make a step's block copies, on every rank, before its forward pass."""
        if self.world_size > 1:
            header, payload = pack_swap(plan.swap_out, plan.swap_in, self.device)
            dist.broadcast(header, src=0)
            dist.broadcast(payload, src=0)
        self.swapper.swap(plan)

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_lora(self, adapter_id: int, path: str) -> None:
        """Read an adapter on every rank (rank 0 first: a bad one raises LoRAError here and
        no other rank hears of it)."""
        self.lora.add(adapter_id, path)
        self._tell_ranks(pack_lora(adapter_id, path, self.device))

    def remove_lora(self, adapter_id: int) -> None:
        self.lora.remove(adapter_id)
        self._tell_ranks(pack_lora(adapter_id, None, self.device))

    def _tell_ranks(self, message: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.world_size > 1:
            for tensor in message:
                dist.broadcast(tensor, src=0)

    def lora_message(self, header: LoRAHeader, payload: torch.Tensor) -> None:
        adapter_id, path = unpack_lora(header, payload)
        if path is None:
            self.lora.remove(adapter_id)
        else:
            self.lora.add(adapter_id, path)

    def lora_context(self, model_input: ModelInput):
        """Fill the slots the step's table names and open its rows' LoRA batch (nothing to do
        for a step without LoRA rows)."""
        if model_input.lora_slots is None:
            return lora_batch(None)
        self.lora.apply(model_input.lora_slots)
        return lora_batch(self.lora.batch(model_input.lora_rows))

    # ---- one step -------------------------------------------------------------------------
    def prepare(
        self,
        inputs: list[SeqInput],
        block_offset: int = 0,
        previous: PreviousTokens | None = None,
    ) -> ModelInput:
        """Decodes of generated tokens first (one row each), then prompt chunks. On CPU, when some
        layer's weights are not on our GEMM (kernels/cpu/gemm*.cpp), the prompt rows are padded
        to a whole number of PREFILL_ROW_TILE tiles (see AttentionMetadata.prefill_row_tile).
        `inputs`: the scheduled sequences as the scheduler's side describes them
        (engine/seq_inputs.py); nothing here sees or changes a live sequence. `block_offset`:
        where the scheduler's blocks start in the pool (pipeline parallelism gives each virtual
        engine its own share). An encoder's step: its whole prompts packed. `previous`: with
        --async-scheduling, the step before's sampled tokens, still on the device, which the
        decode rows holding PLACEHOLDER_TOKEN take (written into the input ids on the device)."""
        if self.encoder:
            return encoder_model_input(inputs, self._to_device)
        decodes: list[SeqInput] = []
        specs: list[SeqInput] = []
        prompts: list[SeqInput] = []
        for item in inputs:
            group = specs if item.proposal else decodes if item.is_decode else prompts
            group.append(item)
        rows = _HostRows(max(len(item.block_table) for item in inputs))
        lora_slots = None
        adapters = {item.lora_id for item in inputs if item.lora_id}
        if adapters:  # the step's slot table; each row gets its sequence's slot
            lora_slots = self.lora.assign(adapters)
            rows.lora_slot_of = {
                adapter: slot for slot, adapter in enumerate(lora_slots) if adapter in adapters
            }
            rows.lora_rows = []
        for item in decodes:
            rows.add(item, block_offset, self.block_size)
        for item in specs:  # a verification's rows are decode rows, one query each (see add_spec)
            rows.add_spec(item, block_offset, self.block_size)
        num_decode_rows = len(rows.input_ids)
        for item in prompts:
            rows.add(item, block_offset, self.block_size)
        graphs = self.decode_graphs
        if (
            graphs is not None
            and not prompts
            and not adapters
            and len(rows.logits_indices) == len(decodes)
            and graphs.fits(num_decode_rows, rows.max_blocks)
        ):
            size = graphs.load(
                rows.input_ids, rows.positions, rows.slot_mapping, rows.seq_lens, rows.block_rows
            )
            graph_ids, graph_positions, graph_metadata = graphs.inputs(size)
            self._resolve_placeholders(graph_ids, rows, previous)
            return ModelInput(
                input_ids=graph_ids,
                positions=graph_positions,
                metadata=graph_metadata,
                logits_indices=graphs.row_indices[:num_decode_rows],
                sampling_inputs=rows.sampling_inputs,
                graph_size=size,
                spec_inputs=rows.spec_inputs,
            )
        tile = prefill_row_tile(self.device)
        if tile and self.pad_prompt_rows:
            rows.pad_prompt_rows(num_decode_rows, tile)
        max_seqlen_q = max([1] + [s.num_new_tokens for s in prompts])
        model_input = self._eager_input(rows, num_decode_rows, max_seqlen_q, tile)
        self._resolve_placeholders(model_input.input_ids, rows, previous)
        if lora_slots is not None:
            model_input.lora_slots = lora_slots
            model_input.lora_rows = self._to_device(rows.lora_rows, torch.long)
        return model_input

    def _resolve_placeholders(
        self, input_ids: torch.Tensor, rows: _HostRows, previous: PreviousTokens | None
    ) -> None:
        """The decode rows whose token the step before sampled get it from that step's tokens
        on the device, in place: the host never waits for them."""
        if not rows.placeholder_rows:
            return
        assert previous is not None, "a placeholder token without the step that samples it"
        targets = self._to_device(rows.placeholder_rows, torch.long)
        sources = self._to_device([previous.row_of[i] for i in rows.placeholder_seqs], torch.long)
        input_ids[targets] = previous.token_ids[sources].to(input_ids.dtype)

    def _eager_input(
        self, rows: _HostRows, num_decodes: int, max_seqlen_q: int, tile: int
    ) -> ModelInput:
        """The step's host rows as device tensors (an eager step, not a captured graph)."""
        to_device = self._to_device
        metadata = AttentionMetadata(
            slot_mapping=to_device(rows.slot_mapping, torch.long),
            block_table=to_device(rows.block_rows, torch.int32),
            cu_seqlens_q=to_device(rows.cu_seqlens_q, torch.int32),
            seq_lens=to_device(rows.seq_lens, torch.int32),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max(rows.seq_lens),
            num_decode_seqs=num_decodes,
            prefill_row_tile=tile,
        )
        model_input = ModelInput(
            input_ids=to_device(rows.input_ids, torch.long),
            positions=to_device(rows.positions, torch.long),
            metadata=metadata,
            logits_indices=to_device(
                rows.logits_indices + rows.spec_rows + rows.prompt_rows, torch.long
            ),
            sampling_inputs=rows.sampling_inputs,
            spec_inputs=rows.spec_inputs,
            image_rows=rows.image_rows,
        )
        mrope = rows.mrope_positions()
        if mrope is not None:
            model_input.mrope_positions = to_device(mrope.tolist(), torch.long)
        if rows.prompt_logprob_inputs:
            model_input.prompt_logprob_inputs = rows.prompt_logprob_inputs
            model_input.prompt_logprob_targets = to_device(rows.prompt_targets, torch.long)
        return model_input

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on this runner's device. On CUDA through pinned memory with
        a non-blocking copy: the host goes on preparing while the copy is queued."""
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        if not values:
            return torch.empty(0, dtype=dtype, device=self.device)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(
        self, model_input: ModelInput, sampling: SamplingBatch | None
    ) -> SamplerOutput | None:
        return self.sample(self.forward(model_input), sampling, model_input)

    @torch.inference_mode()
    def forward(self, model_input: ModelInput) -> torch.Tensor | None:
        """The logits of the sampled rows (rank 0), or None. On CUDA the work is queued and
        this returns at once, so the host can prepare sampling while the device computes."""
        if self.world_size > 1:
            if model_input.image_rows:  # encoded here, placed on every rank
                model_input.image_embeds = gather_image_embeds(
                    model_input.image_rows, self.encoder_cache, self.dtype, self.device
                )
            started = time.perf_counter()
            header, payload = pack_step(model_input, self.device)
            dist.broadcast(header, src=0)
            dist.broadcast(payload, src=0)
            if model_input.image_embeds is not None:
                send_values(model_input.image_embeds)
            self.broadcast_seconds += time.perf_counter() - started
            self.broadcast_steps += 1
        return self._forward(model_input)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor | None,
        sampling: SamplingBatch | None,
        model_input: ModelInput,
        spec_sampling: SamplingBatch | None = None,
    ) -> SamplerOutput | None:
        """Sample the rows of the sequences that completed their prompt; verify the proposals of
        those that speculate (their rows follow the sampled ones; `spec_sampling` is the sampler's
        batch over those rows); score the prompt rows of those that asked for prompt logprobs
        (their logits come last)."""
        if logits is None:
            return None
        num_sampled, num_spec = len(model_input.sampling_inputs), model_input.num_spec_rows
        prompt_logprobs = spec = None
        if model_input.prompt_logprob_inputs:
            prompt_logprobs = self._prompt_logprobs(logits[num_sampled + num_spec :], model_input)
        if num_spec:
            spec = verify(
                logits[num_sampled : num_sampled + num_spec], model_input.spec_inputs, spec_sampling
            )
        logits = logits[:num_sampled]
        if sampling is None:  # no sequence completes its prompt or decodes as usual this step
            if prompt_logprobs is None and spec is None:
                return None
            empty = torch.empty(0, dtype=torch.long, device=logits.device)
            return SamplerOutput(empty, None, None, None, prompt_logprobs, spec)
        output = sample(logits, sampling)
        output.prompt_logprobs, output.spec = prompt_logprobs, spec
        return output

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, model_input: ModelInput) -> LogprobsTensors:
        """Raw (unprocessed) logprobs of each prompt row's next token, and the top k."""
        num_top = max(
            item.sampling.params.prompt_logprobs for item in model_input.prompt_logprob_inputs
        )
        return gather_logprobs(
            logits.float().log_softmax(dim=-1), model_input.prompt_logprob_targets, num_top
        )

    def _forward(self, model_input: ModelInput) -> torch.Tensor | None:
        num_logits = model_input.logits_indices.shape[0]
        if model_input.graph_size:
            # The graph's output rows past num_logits are padding; the real ones all sample.
            hidden = self.decode_graphs.run(model_input.graph_size)
            return self.model.compute_logits(hidden[:num_logits])
        hidden = None
        images = bool(model_input.image_rows) or model_input.image_embeds is not None
        if self.fused_decode is not None and not images:
            lora = None
            if model_input.lora_slots is not None:  # the step's adapters into the slots first
                self.lora.apply(model_input.lora_slots)
                table = self.lora.fused_table(self.model)
                lora = (table, model_input.lora_rows) if table is not None else False
            if lora is not False:
                inputs = (model_input.input_ids, model_input.positions, model_input.metadata)
                hidden = (
                    self.fused_decode.run(*inputs)
                    if lora is None
                    else self.fused_decode.run(*inputs, lora)
                )
        if hidden is None and images:
            with self.lora_context(model_input):
                if model_input.image_embeds is not None:  # tensor parallel: rank 0's rows
                    embeds = model_input.image_embeds.place(
                        self.model.embed_tokens(model_input.input_ids)
                    )
                else:
                    embeds = embed_with_images(
                        self.model.embed_tokens,
                        model_input.input_ids,
                        model_input.image_rows,
                        self.encoder_cache,
                    )
                mrope = model_input.mrope_positions
                hidden = self.model(
                    model_input.input_ids,
                    model_input.positions,
                    model_input.metadata,
                    inputs_embeds=embeds,
                    **({} if mrope is None else {"mrope_positions": mrope}),
                )
        if hidden is None:
            with self.lora_context(model_input):
                hidden = self.model(
                    model_input.input_ids, model_input.positions, model_input.metadata
                )
        if self.pooling:
            return hidden
        if num_logits == 0:
            return None
        return self.model.compute_logits(hidden[model_input.logits_indices])

    @torch.inference_mode()
    def worker_loop(self) -> None:
        """Ranks > 0: run each step rank 0 broadcasts, until it sends stop."""
        if self.pipeline is not None:
            self.pipeline.worker_loop()
            return
        received = empty_header(self.device)
        while True:
            dist.broadcast(received, src=0)
            header = read_header(received)
            if isinstance(header, StopHeader):
                dist.barrier()  # the other half of broadcast_stop's handshake
                return
            payload = torch.empty(header.payload_size(), dtype=torch.long, device=self.device)
            dist.broadcast(payload, src=0)
            if isinstance(header, SwapHeader):
                self.swapper.swap(SwapPlan(*unpack_swap(header, payload)))
            elif isinstance(header, LoRAHeader):
                self.lora_message(header, payload)
            else:
                model_input = unpack_step(header, payload)
                if model_input.image_embeds is not None:
                    receive_values(
                        model_input.image_embeds,
                        self.model_config.hidden_size,
                        self.dtype,
                        self.device,
                    )
                self._forward(model_input)

    def shutdown(self) -> None:
        if self.world_size > 1 and self.rank == 0:
            if self.pipeline is not None:
                self.pipeline.drain()
            broadcast_stop(self.device)


@dataclass(slots=True)
class _HostRows:
    """One step's per-row and per-sequence lists, built on the host before they go to the
    device (or into the decode graphs' buffers)."""

    max_blocks: int  # the widest block table: every row of block_rows is padded to it
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_rows: list[list[int]] = field(
        default_factory=list
    )  # padded with block 0, never read past seq_lens
    logits_indices: list[int] = field(default_factory=list)
    sampling_inputs: list[SeqInput] = field(default_factory=list)
    # Prompt logprobs: the rows scored, each one's next prompt token, and the sequences scored.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_logprob_inputs: list[SeqInput] = field(default_factory=list)
    # Speculative decoding: the verification rows (their logits follow the sampled rows) and
    # the sequences they verify.
    spec_rows: list[int] = field(default_factory=list)
    spec_inputs: list[SeqInput] = field(default_factory=list)
    # LoRA: each row's slot (-1: the base model), kept only in a step with some adapter's rows.
    lora_rows: list[int] | None = None
    lora_slot_of: dict[int, int] = field(default_factory=dict)
    # Vision-language models: (the step row of an image slice's first token, the slice).
    image_rows: list[tuple[int, ImageSlice]] = field(default_factory=list)
    # M-RoPE: (the step row of a sequence's first token, its rows' [3, n] positions).
    mrope_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # --async-scheduling: the decode rows holding PLACEHOLDER_TOKEN, and their sequences.
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_seqs: list[int] = field(default_factory=list)

    def mrope_positions(self) -> torch.Tensor | None:
        """[3, rows]: each row's position thrice, the image rows' M-RoPE ones in their place."""
        if not self.mrope_rows:
            return None
        positions = torch.tensor(self.positions, dtype=torch.long).repeat(3, 1)
        for row, rows in self.mrope_rows:
            positions[:, row : row + rows.shape[1]] = rows
        return positions

    def _add_lora_rows(self, item: SeqInput, count: int) -> None:
        if self.lora_rows is not None:
            self.lora_rows.extend([self.lora_slot_of.get(item.lora_id, -1)] * count)

    def _block_table(self, item: SeqInput, block_offset: int) -> list[int]:
        """Its blocks' ids in the whole pool (the scheduler's share starts at block_offset)."""
        if block_offset:
            return [block + block_offset for block in item.block_table]
        return list(item.block_table)

    def add_spec(self, item: SeqInput, block_offset: int, block_size: int) -> None:
        """A sequence's last token and its k proposed tokens as k + 1 decode rows: row j is one
        query at position start + j that sees the keys up to it (its own seq_len), the earlier
        rows' keys being stored in the same layer before attention reads them. Each row is
        then computed exactly as a decode of that token would be (same kernels, same bits)."""
        table = self._block_table(item, block_offset)
        padded = table + [0] * (self.max_blocks - len(table))
        for position, token in enumerate(item.token_ids, item.start):
            self.input_ids.append(token)
            self.positions.append(position + item.position_shift)
            self.slot_mapping.append(
                table[position // block_size] * block_size + position % block_size
            )
            self.cu_seqlens_q.append(self.cu_seqlens_q[-1] + 1)
            self.seq_lens.append(position + 1)
            self.block_rows.append(padded)
            self.spec_rows.append(len(self.input_ids) - 1)
        self.spec_inputs.append(item)
        self._add_lora_rows(item, item.num_new_tokens)

    def add(self, item: SeqInput, block_offset: int, block_size: int) -> None:
        """One sequence's rows: its tokens from `start` on, num_new_tokens of them."""
        start, count = item.start, item.num_new_tokens
        end = start + count
        if item.prompt_logprob_targets:  # rows whose next token is a prompt token to score
            row = len(self.input_ids) + item.prompt_logprob_offset
            self.prompt_rows.extend(range(row, row + len(item.prompt_logprob_targets)))
            self.prompt_targets.extend(item.prompt_logprob_targets)
            self.prompt_logprob_inputs.append(item)
        self.image_rows.extend((len(self.input_ids) + piece.row, piece) for piece in item.images)
        if item.mrope_positions is not None:
            self.mrope_rows.append((len(self.input_ids), item.mrope_positions))
        if item.is_decode and item.token_ids[0] == PLACEHOLDER_TOKEN:
            self.placeholder_rows.append(len(self.input_ids))
            self.placeholder_seqs.append(item.seq_id)
        self.input_ids.extend(item.token_ids)
        self._add_lora_rows(item, count)
        shift = item.position_shift  # M-RoPE: text after images sits earlier than its index
        self.positions.extend(range(start + shift, end + shift))
        table = self._block_table(item, block_offset)
        self.slot_mapping.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        self.cu_seqlens_q.append(self.cu_seqlens_q[-1] + count)
        self.seq_lens.append(end)
        self.block_rows.append(table + [0] * (self.max_blocks - len(table)))
        if item.completes_prompt:
            self.logits_indices.append(self.cu_seqlens_q[-1] - 1)
            self.sampling_inputs.append(item)

    def pad_prompt_rows(self, num_decodes: int, tile: int) -> None:
        """Prompt rows up to a whole number of `tile`-row tiles (slot -1: nothing is stored)."""
        num_prompt_rows = len(self.input_ids) - num_decodes
        if num_prompt_rows % tile:
            padding = tile - num_prompt_rows % tile
            self.input_ids.extend([0] * padding)
            if self.lora_rows is not None:
                self.lora_rows.extend([-1] * padding)
            self.positions.extend([0] * padding)
            self.slot_mapping.extend([-1] * padding)
