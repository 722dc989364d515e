"""Starting the tensor- and pipeline-parallel ranks: checks before anything loads, rendezvous, worker processes.

Rank 0 lives in the serving (or offline) process and spawns this host's other ranks, each running
the target the engine hands over (engine/worker.run_worker); this package knows process groups
and processes, not models. With
--nnodes > 1, the other hosts run `nanoserve serve --nnodes N --node-rank K ...`, which starts
only that host's ranks; all join through torch.distributed's TCP rendezvous at
--master-addr:--master-port.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import resource_tracker

import torch
import torch.distributed as dist

from nanoserve import envs
from nanoserve.config import EngineConfig
from nanoserve.distributed.rank import Topology, keep_master_store, rank_main, resolve_device_type

logger = logging.getLogger(__name__)


# A single host's rendezvous without --master-port: rank 0's TCPStore, listening on a port the
# OS picked when it was made and bound ever since (init_method -> store). Picking a free port by
# binding 0 and closing it would leave a window in which another process (a second test suite,
# another server) could take it before the rendezvous binds it.
LOCAL_RENDEZVOUS = "tcp://127.0.0.1:0"
LOOPBACK = "127.0.0.1"


def loopback_listener() -> tuple[int, int]:
    """A socket listening on 127.0.0.1 only, on a port the OS picks: its descriptor, for the
    store to take over, and the port. TCPStore given a port binds every interface (and has no authentication):
    any host that reaches rank 0 could read and write the rendezvous."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    return listener.detach(), port


def loopback_interface() -> str | None:
    """The loopback interface's name (Linux: lo), for gloo's and NCCL's sockets."""
    names = [name for _, name in socket.if_nameindex()]
    if "lo" in names:
        return "lo"
    return next((name for name in names if name.startswith("lo")), None)


def own_rendezvous(topology: Topology) -> Topology:
    """The topology with a single host's automatic rendezvous made concrete: rank 0's store is
    created here (in rank 0's process, before any other rank starts) and kept for init_rank;
    the other ranks get its address. Everything the ranks listen on is loopback only: the store's
    socket, and gloo's and NCCL's (their interface, set before any rank starts). Any other
    topology (--master-addr, several hosts) is returned as it is."""
    if topology.init_method != LOCAL_RENDEZVOUS or topology.world_size == 1:
        return topology
    interface = loopback_interface()
    if interface is not None:
        envs.set_loopback_sockets_default(interface)
    listen_fd, port = loopback_listener()
    try:
        store = dist.TCPStore(
            LOOPBACK,
            port,
            topology.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(minutes=10),
            master_listen_fd=listen_fd,
        )
    except BaseException:
        os.close(listen_fd)
        raise
    init_method = f"tcp://{LOOPBACK}:{store.port}"
    keep_master_store(init_method, store)
    return dataclasses.replace(topology, init_method=init_method, store_rendezvous=True)


def check_topology(config: EngineConfig, layer_partition: tuple = ()) -> Topology:
    """The ranks, their backend and rendezvous; every mistake here is one clear ValueError, raised
    before any rank starts. `layer_partition`: each pipeline stage's [start, end) decoder layers
    (the engine's plan, engine/worker.py, which also checks the model splits across the ranks)."""
    pp_size = config.pipeline_parallel_size
    tp_size = config.tensor_parallel_size
    world = tp_size * pp_size
    if config.nnodes < 1 or world % config.nnodes:
        raise ValueError(
            f"--nnodes {config.nnodes} must divide the {world} ranks (tensor x pipeline parallel size)"
        )
    if not 0 <= config.node_rank < config.nnodes:
        raise ValueError(f"--node-rank must be in [0, {config.nnodes}), got {config.node_rank}")
    ranks_per_node = world // config.nnodes
    device_type = resolve_device_type(config)
    if device_type == "cuda":
        available = torch.cuda.device_count()
        if ranks_per_node > available:
            raise ValueError(
                f"{ranks_per_node} ranks per node need {ranks_per_node} GPUs; this host has {available}"
            )
        backend = "nccl"
    else:
        # CPU ranks share the cores; beyond a few per core they only thrash.
        limit = 4 * (os.cpu_count() or 1)
        if ranks_per_node > limit:
            raise ValueError(
                f"{ranks_per_node} CPU ranks on a host with {os.cpu_count()} cores is too many "
                f"(at most {limit})"
            )
        backend = "gloo"
    if world > 1:
        if not dist.is_available():
            raise ValueError(
                "this torch build has no torch.distributed; tensor and pipeline parallelism need it"
            )
        if backend == "nccl" and not dist.is_nccl_available():
            raise ValueError("the NCCL backend is not available in this torch build")
        if backend == "gloo" and not dist.is_gloo_available():
            raise ValueError("the gloo backend is not available in this torch build")
    if config.nnodes > 1:
        if not config.master_addr or not config.master_port:
            raise ValueError(
                "--nnodes > 1 needs --master-addr and --master-port (rank 0's host and a free port)"
            )
        init_method = f"tcp://{config.master_addr}:{config.master_port}"
    elif config.master_addr and config.master_port:
        init_method = f"tcp://{config.master_addr}:{config.master_port}"
    else:
        init_method = LOCAL_RENDEZVOUS  # made concrete by own_rendezvous when the ranks start
    return Topology(
        world,
        ranks_per_node,
        config.node_rank,
        backend,
        init_method,
        device_type,
        config.cpu_threads,
        tp_size,
        pp_size,
        tuple(layer_partition),
    )


_groups: set[WorkerGroup] = (
    set()
)  # the groups this process started whose ranks are not all reaped yet


def kill_every_rank() -> None:
    """SIGKILL every rank this process started and wait until they are gone: for a forced exit
    (a signal handler on the main thread), even while a group is still starting its ranks."""
    for group in list(_groups):
        group.kill()


class WorkerGroup:
    """This host's ranks other than rank 0, as child processes, started and reaped by one thread.
    Each joins the process group, then runs `target(device, *args)` (rank.rank_main); `target` is
    a module-level function (spawn pickles it by name)."""

    def __init__(
        self,
        topology: Topology,
        target: Callable[..., None],
        args: tuple = (),
        skip_rank_zero: bool = True,
    ):
        topology = self.topology = own_rendezvous(topology)  # rank 0 joins through self.topology
        context = multiprocessing.get_context("spawn")
        ranks = [rank for rank in topology.local_ranks if not (rank == 0 and skip_rank_zero)]
        to_start = [
            context.Process(
                target=rank_main,
                args=(target, args, topology, rank),
                name=f"nanoserve-rank{rank}",
                daemon=True,
            )
            for rank in ranks
        ]
        self.processes: list[multiprocessing.Process] = []
        self.failure: str | None = None
        self._on_failure = []
        self._stopping = False
        self._lock = (
            threading.Lock()
        )  # kill() from another thread while the ranks are being started
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        # Started now, not by the first spawn: starting the tracker unblocks SIGINT (see _start).
        resource_tracker.ensure_running()
        self._watchdog = threading.Thread(
            target=self._watch, args=(to_start,), name="nanoserve-tp-watchdog", daemon=True
        )
        _groups.add(self)
        self._watchdog.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def on_failure(self, callback) -> None:
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _start(self, to_start: list[multiprocessing.Process]) -> None:
        """On the watchdog thread, which outlives the ranks: a rank's PR_SET_PDEATHSIG (rank.py)
        fires when the thread that started it ends, not the process, and the thread that builds
        the engine may end first (the server's step thread does, before rank 0 broadcasts STOP).
        With SIGINT blocked in this thread, so the ranks start with it blocked (a signal mask
        survives fork and exec): a Ctrl-C to the whole process group while a rank's interpreter
        starts and imports torch cannot kill it; rank_main then ignores SIGINT and unblocks it,
        as multiprocessing's resource tracker does (bpo-33613). Rank 0 decides when ranks stop."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        for process in to_start:
            with self._lock:
                if self._stopping:
                    return
                process.start()
                self.processes.append(process)

    def _watch(self, to_start: list[multiprocessing.Process]) -> None:
        """Start the ranks, then reap them: the only place that does (two threads joining one
        process race for its exit code). A rank that exits non-zero while we are not stopping is
        a failure."""
        from multiprocessing.connection import wait

        try:
            self._start(to_start)
        except BaseException as error:  # __init__ raises it; the ranks already started are killed
            self._start_error = error
            self._stopping = True
            for process in self.processes:
                process.kill()
        finally:
            self._started.set()
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
        _groups.discard(self)

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
        """SIGKILL the ranks and wait until they are gone. From any thread: the watchdog's own (a
        failure callback), or another while the watchdog is still starting ranks."""
        from multiprocessing.connection import wait

        with self._lock:
            self._stopping = True
            processes = list(self.processes)
        for process in processes:
            if process.exitcode is None:
                try:
                    process.kill()
                except (OSError, ValueError):  # already reaped
                    pass
        # SIGKILL cannot be ignored: each exits. wait() returns when any one is ready and, given
        # none, never (a kill before the watchdog started the first rank, or a host whose only
        # local rank is rank 0): wait for each in turn, and only for those there are.
        for process in processes:
            wait([process.sentinel])
        if threading.current_thread() is not self._watchdog:
            self.wait()  # the watchdog reaps them all


def run_ranks(topology: Topology, target: Callable[..., None], args: tuple = ()) -> int:
    """A host with --node-rank > 0: run all of its ranks until rank 0 stops them (or one fails);
    the exit code."""
    group = WorkerGroup(topology, target, args, skip_rank_zero=False)
    failed = threading.Event()
    group.on_failure(lambda reason: failed.set())

    def stop(signum, frame):
        group.kill()
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    nnodes = topology.world_size // topology.ranks_per_node
    print(
        f"nanoserve: node {topology.node_rank}/{nnodes} running ranks "
        f"{list(topology.local_ranks)}, rendezvous {topology.init_method}",
        flush=True,
    )
    group.wait()
    codes = {p.name: p.exitcode for p in group.processes}
    if any(code != 0 for code in codes.values()):
        print(
            f"nanoserve: node {topology.node_rank}: rank exit codes {codes}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0
