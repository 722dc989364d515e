"""CUDA graphs for decode-only steps, as vLLM does it.

At startup one graph of the model's forward pass is captured per batch size of a ladder
(1, 2, 4, 8, then multiples of 8 up to --max-num-seqs, at most 512). A decode step of n
sequences is padded to the smallest captured size b >= n: its rows are copied into static input
buffers (allocated once, at the largest size; the graph reads them by address) and the graph is
replayed. Padded rows are harmless: token 0 at position 0, slot -1 (the KV store skips it), KV
length 1, so they read one cached key and write nothing. Steps with prompt rows, and decode
steps larger than the largest size, run eagerly.

Everything but the capture runs on a CPU as well (``capture=False``): the same static buffers,
the same padding, and the same forward on them, called eagerly. The tests use that to check
that the padded static-buffer step computes what the plain eager step computes.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's largest captured decode batch
PAD_SLOT = -1  # slot_mapping of a padded row: the KV store writes nothing for it


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder 1, 2, 4, 8, 16, 24, ... up to the first size that holds max_num_seqs
    sequences, at most MAX_CAPTURE_SIZE."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


@dataclass(slots=True)
class CaptureStats:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs took (free memory before minus after)


class DecodeBuffers:
    """The per-row inputs of a decode step for up to max_batch sequences."""

    def __init__(self, max_batch: int, device: torch.device, pin_memory: bool = False) -> None:
        def make(fill, dtype):
            return torch.full((max_batch,), fill, dtype=dtype, device=device, pin_memory=pin_memory)

        self.input_ids = make(0, torch.long)
        self.positions = make(0, torch.long)
        self.slot_mapping = make(PAD_SLOT, torch.long)
        self.seq_lens = make(1, torch.int32)

    def vectors(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slot_mapping, self.seq_lens


PADDING = (0, 0, PAD_SLOT, 1)  # what a padded row holds, in DecodeBuffers.vectors() order


class DecodeGraphs:
    """Static buffers, bucket choice and padding for decode steps; with ``capture`` (the
    default on CUDA) one CUDA graph per bucket, replayed by :meth:`run`."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        prefill_row_tile: int = 0,
        capture: bool | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # A static upper bound for the attention kernel: it sets the decode split count, which a
        # captured graph must not change from step to step.
        self.max_seqlen_k = max_model_len
        self.prefill_row_tile = prefill_row_tile
        self.capture_enabled = device.type == "cuda" if capture is None else capture
        if self.capture_enabled and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.static = DecodeBuffers(self.max_batch, device)
        # Entries past a sequence's own blocks may be stale from an earlier step; they are never
        # read past seq_lens, and hold only block ids (or 0), so any read stays in bounds.
        self.block_table = torch.zeros(
            (self.max_batch, self.max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.cu_seqlens_q = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.row_indices = torch.arange(self.max_batch, dtype=torch.long, device=device)
        self.host: DecodeBuffers | None = None
        if device.type == "cuda":
            # A step is assembled in pinned host memory and sent with non-blocking copies; the
            # block table travels compact (rows of this step's width) and is spread on the device.
            self.host = DecodeBuffers(self.max_batch, torch.device("cpu"), pin_memory=True)
            table_size = self.max_batch * self.max_blocks_per_seq
            self.host_table = torch.zeros(table_size, dtype=torch.int32, pin_memory=True)
            self.staged_table = torch.zeros(table_size, dtype=torch.int32, device=device)
            # Recorded after a step's copies: the next step waits on it before it overwrites
            # the pinned buffers those copies read.
            self._copied = torch.cuda.Event()
        self._metadata = {size: self._make_metadata(size) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_steps = 0  # decode steps that went through the static buffers

    # ---- bucket choice ----------------------------------------------------------------------
    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured size holding `batch` rows; None above the largest."""
        index = bisect.bisect_left(self.sizes, batch)
        return self.sizes[index] if batch >= 1 and index < len(self.sizes) else None

    def fits(self, batch: int, max_blocks: int) -> bool:
        return self.bucket_for(batch) is not None and max_blocks <= self.max_blocks_per_seq

    # ---- one step's inputs ------------------------------------------------------------------
    def load(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_rows: list[list[int]],
    ) -> int:
        """Write one decode step (n rows; block_rows all of one width) into the static
        buffers, padded up to its bucket, which is returned."""
        batch = len(input_ids)
        size = self.bucket_for(batch)
        width = len(block_rows[0]) if block_rows else 0
        if size is None or width > self.max_blocks_per_seq:
            raise ValueError(
                f"a decode step of {batch} rows and {width} blocks does not fit the "
                f"captured sizes (up to {self.max_batch} rows, {self.max_blocks_per_seq} blocks)"
            )
        rows = torch.tensor(block_rows, dtype=torch.int32)
        if self.host is None:  # the static buffers are on the host: write them in place
            self._write_rows(
                self.static, batch, size, (input_ids, positions, slot_mapping, seq_lens)
            )
            self.block_table[:batch, :width].copy_(rows)
        else:
            self._copied.synchronize()
            self._write_rows(self.host, batch, size, (input_ids, positions, slot_mapping, seq_lens))
            for target, source in zip(self.static.vectors(), self.host.vectors()):
                target[:size].copy_(source[:size], non_blocking=True)
            count = batch * width
            self.host_table[:count].copy_(rows.view(-1))
            staged = self.staged_table[:count]
            staged.copy_(self.host_table[:count], non_blocking=True)
            self.block_table[:batch, :width].copy_(staged.view(batch, width))
            self._copied.record()
        self.num_steps += 1
        return size

    @staticmethod
    def _write_rows(
        buffers: DecodeBuffers, batch: int, size: int, values: tuple[list[int], ...]
    ) -> None:
        for buffer, column, pad in zip(buffers.vectors(), values, PADDING):
            buffer[:batch].copy_(torch.tensor(column, dtype=buffer.dtype))
            buffer[batch:size].fill_(pad)

    def _make_metadata(self, size: int) -> AttentionMetadata:
        static = self.static
        return AttentionMetadata(
            slot_mapping=static.slot_mapping[:size],
            block_table=self.block_table[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=static.seq_lens[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
            num_decode_seqs=size,
            prefill_row_tile=self.prefill_row_tile,
        )

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a step of this bucket: views of the static
        buffers, the same objects every step."""
        return self.static.input_ids[:size], self.static.positions[:size], self._metadata[size]

    # ---- running ----------------------------------------------------------------------------
    def forward(self, size: int) -> torch.Tensor:
        """The eager forward pass over the static buffers of this bucket."""
        input_ids, positions, metadata = self.inputs(size)
        return self.model(input_ids, positions, metadata)

    def run(self, size: int) -> torch.Tensor:
        """Hidden states [size, hidden] of the loaded step: the captured graph replayed, or the
        eager forward on the same buffers where nothing was captured."""
        graph = self.graphs.get(size)
        if graph is None:
            return self.forward(size)
        graph.replay()
        return self.outputs[size]

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Capture one graph per size, largest first so the smaller ones reuse its memory pool.
        The buffers hold padding meanwhile, so capture writes nothing into the KV cache."""
        if not self.capture_enabled:
            raise RuntimeError("capture needs a CUDA device and capture enabled")
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for buffer, pad in zip(self.static.vectors(), PADDING):
            buffer.fill_(pad)
        self.block_table.zero_()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what the warm-ups left cached is not the graphs' memory
        stats = CaptureStats(
            list(self.sizes),
            time.perf_counter() - started,
            free_before - torch.cuda.mem_get_info(self.device)[0],
        )
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1 to %d) in %.1f s, %.2f GiB",
            len(stats.sizes),
            self.max_batch,
            stats.seconds,
            stats.memory_bytes / (1 << 30),
        )
        return stats
