"""The other ranks (tensor / pipeline parallelism) as rank 0's engine holds them: started
before the model loads, watched, and stopped at shutdown. A rank lost during start-up ends the
process (rank 0 may be blocked in a rendezvous or collective that will never complete); once
serving, it marks the engine dead and tells whoever asked (the server answers its clients)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.distributed import set_parallel_state
from nanoserve.distributed.launcher import WorkerGroup
from nanoserve.distributed.rank import Topology, init_rank
from nanoserve.engine.worker import start_workers

logger = logging.getLogger(__name__)


class OtherRanks:
    def __init__(self) -> None:
        self.workers: WorkerGroup | None = None  # None: one rank only
        self.serving = False  # False while starting: a rank lost then ends the process
        self.dead_reason: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []

    def start(self, config: EngineConfig, topology: Topology, model_dir: str) -> torch.device:
        """Start ranks 1.. and join them as rank 0; returns rank 0's device."""
        self.workers = start_workers(config, topology, model_dir)
        self.workers.on_failure(self._fail_during_startup)
        return init_rank(self.workers.topology, 0)

    def now_serving(self) -> None:
        self.serving = True
        if self.workers is not None:
            self.workers.on_failure(self._on_failure)

    def _fail_during_startup(self, reason: str) -> None:
        if not self.serving:
            logger.error("%s during startup; exiting", reason)
            self.workers.kill()
            os._exit(1)

    def _on_failure(self, reason: str) -> None:
        self.dead_reason = reason
        for callback in list(self._failure_callbacks):
            callback(reason)

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)
        if self.dead_reason is not None:
            callback(self.dead_reason)

    def stop(self, tell_ranks: Callable[[], None]) -> None:
        """`tell_ranks` ends the ranks' step loops (skipped when one is already gone); then they
        are stopped and the process group left."""
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        if self.dead_reason is None:
            try:
                tell_ranks()
            except Exception:  # a rank already gone: nothing to tell it
                pass
        workers.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        set_parallel_state(0, 1)
