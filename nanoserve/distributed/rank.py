"""One rank's place in the tensor x pipeline layout (Topology), its device, joining the process
group (init_rank), and the main function of a rank's process (rank_main): what both the launcher
and a worker rank need."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.distributed import set_parallel_state
from nanoserve.kernels.cpu.threads import threads_per_rank

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
    # The rendezvous is rank 0's own TCPStore (launcher.own_rendezvous): every rank passes a
    # store to init_process_group (rank 0 the one it made, the others a client of it).
    store_rendezvous: bool = False

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


def resolve_device_type(config: EngineConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


_master_stores: dict[str, dist.TCPStore] = {}


def keep_master_store(init_method: str, store: dist.TCPStore) -> None:
    """Rank 0's store for a rendezvous its process made (launcher.own_rendezvous)."""
    _master_stores[init_method] = store


def init_rank(topology: Topology, rank: int) -> torch.device:
    """Join the process group as `rank` and return this rank's device."""
    local_rank = rank - topology.node_rank * topology.ranks_per_node
    if topology.device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_per_rank(topology.cpu_threads, topology.ranks_per_node))
    tp_group = None  # pp == 1: the whole world is the tensor-parallel group
    if topology.world_size > 1:
        timeout = timedelta(minutes=10)
        if topology.store_rendezvous:
            store = (
                _master_stores.pop(topology.init_method)
                if rank == 0
                else dist.TCPStore(
                    "127.0.0.1",
                    int(topology.init_method.rsplit(":", 1)[1]),
                    topology.world_size,
                    is_master=False,
                    timeout=timeout,
                )
            )
            dist.init_process_group(
                topology.backend,
                store=store,
                rank=rank,
                world_size=topology.world_size,
                timeout=timeout,
            )
        else:
            dist.init_process_group(
                topology.backend,
                init_method=topology.init_method,
                rank=rank,
                world_size=topology.world_size,
                timeout=timeout,
            )
        if topology.pp_size > 1 and topology.tp_size > 1:
            # Every rank creates every stage's group, in the same order (new_group is collective).
            for stage in range(topology.pp_size):
                ranks = list(range(stage * topology.tp_size, (stage + 1) * topology.tp_size))
                group = dist.new_group(ranks)
                if rank in ranks:
                    tp_group = group
    set_parallel_state(
        rank,
        topology.world_size,
        topology.tp_size,
        topology.pp_size,
        tp_group,
        topology.layer_partition,
    )
    return device


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no rank outlives the server. (Strictly, when
    the parent thread that started us ends: WorkerGroup's watchdog, which outlives the ranks.)"""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def rank_main(target: Callable[..., None], args: tuple, topology: Topology, rank: int) -> None:
    """A worker process (launcher.WorkerGroup starts it): join the process group as `rank`, then
    `target(device, *args)` (the engine's worker entry, engine/worker.run_worker) until it
    returns. A failure exits non-zero; the watchdog on rank 0 reports the exit code."""
    _die_with_parent()
    # Ctrl-C reaches the whole process group; rank 0 decides when workers stop. WorkerGroup
    # started us with SIGINT blocked (see there); ignore it before unblocking it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s")
    try:
        target(init_rank(topology, rank), *args)
    except Exception as error:
        logger.error("worker rank %d failed: %s", rank, error)
        sys.exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
