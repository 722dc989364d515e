"""Starting the tensor- and pipeline-parallel ranks: checks before anything loads, rendezvous, worker processes.

Rank 0 lives in the serving (or offline) process and spawns this host's other ranks. With
--nnodes > 1, the other hosts run `nanoserve serve --nnodes N --node-rank K ...`, which starts
only that host's ranks; all join through torch.distributed's TCP rendezvous at
--master-addr:--master-port.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.cpu_threads import threads_per_rank
from nanoserve.distributed.pipeline import layer_partition, partition_override
from nanoserve.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Topology:
    world_size: int
    ranks_per_node: int
    node_rank: int
    backend: str
    init_method: str
    device_type: str
    cpu_threads: int | None = None  # EngineConfig.cpu_threads
    tp_size: int = 1
    pp_size: int = 1
    layer_partition: tuple = ()  # each stage's [start, end) decoder layers when pp_size > 1

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def resolve_device_type(config: EngineConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def check_topology(config: EngineConfig, model_config: ModelConfig) -> Topology:
    """Every mistake here is one clear ValueError, raised before any weight is read."""
    world = config.tensor_parallel_size
    pp_size = config.pipeline_parallel_size
    partition = ()
    if pp_size > 1:
        partition = tuple(layer_partition(model_config.num_hidden_layers, pp_size, partition_override()))
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    if heads % world:
        raise ValueError(f"--tensor-parallel-size {world} does not divide the model's {heads} attention heads")
    if kv_heads >= world and kv_heads % world:
        raise ValueError(f"--tensor-parallel-size {world} does not divide the model's {kv_heads} KV heads")
    if kv_heads < world and world % kv_heads:
        raise ValueError(f"--tensor-parallel-size {world} is not a multiple of the model's {kv_heads} KV heads "
                         "(needed to replicate them)")
    if model_config.intermediate_size % world:
        raise ValueError(f"--tensor-parallel-size {world} does not divide the MLP size "
                         f"{model_config.intermediate_size}")
    tp_size, world = world, world * pp_size
    if config.nnodes < 1 or world % config.nnodes:
        raise ValueError(f"--nnodes {config.nnodes} must divide the {world} ranks (tensor x pipeline parallel size)")
    if not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"--node-rank must be in [0, {config.nnodes}), got {config.node_rank}")
    ranks_per_node = world // config.nnodes
    device_type = resolve_device_type(config)
    if device_type == "cuda":
        available = torch.cuda.device_count()
        if ranks_per_node > available:
            raise ValueError(f"{ranks_per_node} ranks per node need {ranks_per_node} GPUs; this host has {available}")
        backend = "nccl"
    else:
        # CPU ranks share the cores; beyond a few per core they only thrash.
        limit = 4 * (os.cpu_count() or 1)
        if ranks_per_node > limit:
            raise ValueError(f"{ranks_per_node} CPU ranks on a host with {os.cpu_count()} cores is too many "
                             f"(at most {limit})")
        backend = "gloo"
    if world > 1:
        if not dist.is_available():
            raise ValueError("this torch build has no torch.distributed; tensor and pipeline parallelism need it")
        if backend == "nccl" and not dist.is_nccl_available():
            raise ValueError("the NCCL backend is not available in this torch build")
        if backend == "gloo" and not dist.is_gloo_available():
            raise ValueError("the gloo backend is not available in this torch build")
    if config.nnodes > 1:
        if not config.master_addr or not config.master_port:
            raise ValueError("--nnodes > 1 needs --master-addr and --master-port (rank 0's host and a free port)")
        init_method = f"tcp://{config.master_addr}:{config.master_port}"
    elif config.master_addr and config.master_port:
        init_method = f"tcp://{config.master_addr}:{config.master_port}"
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    return Topology(world, ranks_per_node, config.node_rank, backend, init_method, device_type, config.cpu_threads,
                    tp_size, pp_size, partition)


def init_rank(topology: Topology, rank: int) -> torch.device:
    """Join the process group as `rank` and return this rank's device."""
    from datetime import timedelta

    from nanoserve.distributed import set_parallel_state

    local_rank = rank - topology.node_rank * topology.ranks_per_node
    if topology.device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_per_rank(topology.cpu_threads, topology.ranks_per_node))
    tp_group = None  # pp == 1: the whole world is the tensor-parallel group
    if topology.world_size > 1:
        dist.init_process_group(topology.backend, init_method=topology.init_method, rank=rank,
                                world_size=topology.world_size, timeout=timedelta(minutes=10))
        if topology.pp_size > 1 and topology.tp_size > 1:
            # Every rank creates every stage's group, in the same order (new_group is collective).
            for stage in range(topology.pp_size):
                ranks = list(range(stage * topology.tp_size, (stage + 1) * topology.tp_size))
                group = dist.new_group(ranks)
                if rank in ranks:
                    tp_group = group
    set_parallel_state(rank, topology.world_size, topology.tp_size, topology.pp_size, tp_group,
                       topology.layer_partition)
    return device


class WorkerGroup:
    """This host's ranks other than rank 0, as child processes, watched by a thread."""

    def __init__(self, config: EngineConfig, topology: Topology, model_dir: str, skip_rank_zero: bool = True):
        from nanoserve.distributed.worker import worker_main

        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.failure: str | None = None
        self._on_failure = []
        self._stopping = False
        for rank in topology.local_ranks:
            if rank == 0 and skip_rank_zero:
                continue
            process = context.Process(target=worker_main, args=(config, topology, rank, model_dir),
                                      name=f"nanoserve-rank{rank}", daemon=True)
            process.start()
            self.processes.append(process)
        self._watchdog = threading.Thread(target=self._watch, name="nanoserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def on_failure(self, callback) -> None:
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _watch(self) -> None:
        """The only place that reaps the ranks (two threads joining one process race for its
        exit code). A rank that exits non-zero while we are not stopping is a failure."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: p for p in self.processes}
        while sentinels:
            for ready in wait(list(sentinels)):
                process = sentinels.pop(ready)
                process.join()
                if self._stopping or process.exitcode == 0 or self.failure is not None:
                    continue
                self.failure = f"parallel worker {process.name} died (exit code {process.exitcode})"
                logger.error(self.failure)
                for callback in list(self._on_failure):
                    callback(self.failure)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every rank has exited and been reaped; True if they have."""
        self._watchdog.join(timeout)
        return not self._watchdog.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """After rank 0 broadcast STOP: give the ranks `timeout` seconds to exit, then kill."""
        self._stopping = True
        if not self.wait(timeout):
            self.kill()

    def kill(self) -> None:
        self._stopping = True
        for process in self.processes:
            if process.exitcode is None:
                try:
                    process.kill()
                except (OSError, ValueError):  # already reaped
                    pass
        self.wait()  # SIGKILL cannot be ignored: the watchdog reaps them all


def run_node(config: EngineConfig, model_dir: str) -> int:
    """A host with --node-rank > 0: run its ranks until rank 0 stops them (or one fails)."""
    import signal

    topology = check_topology(config, ModelConfig.from_dir(model_dir))
    group = WorkerGroup(config, topology, model_dir, skip_rank_zero=False)
    failed = threading.Event()
    group.on_failure(lambda reason: failed.set())

    def stop(signum, frame):
        group.kill()
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"nanoserve: node {config.node_rank}/{config.nnodes} running ranks "
          f"{list(topology.local_ranks)}, rendezvous {topology.init_method}", flush=True)
    group.wait()
    codes = {p.name: p.exitcode for p in group.processes}
    if any(code != 0 for code in codes.values()):
        print(f"nanoserve: node {config.node_rank}: rank exit codes {codes}", file=sys.stderr, flush=True)
        return 1
    return 0
