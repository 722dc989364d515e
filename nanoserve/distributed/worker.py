"""Ranks > 0: build the same model on this rank's weight shard, then run every step that rank 0
broadcasts until it says stop (ModelRunner.worker_loop; the step's wire format is beside
ModelInput, in engine/model_input.py). The one module of distributed/ that imports the engine: the
worker entry point."""
from __future__ import annotations

import ctypes
import logging
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from nanoserve.distributed.rank import init_rank
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.models.config import ModelConfig

logger = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no rank outlives the server. (Strictly, when
    the parent thread that started us ends: WorkerGroup's watchdog, which outlives the ranks.)"""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(config, topology, rank: int, model_dir: str) -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole process group; rank 0 decides when workers stop. WorkerGroup
    # started us with SIGINT blocked (see there); ignore it before unblocking it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s")
    try:
        device = init_rank(topology, rank)
        runner = ModelRunner(config, ModelConfig.from_dir(model_dir), Path(model_dir), device=device)
        runner.worker_loop()
    except Exception as error:  # the watchdog on rank 0 reports our exit code
        logger.error("worker rank %d failed: %s", rank, error)
        sys.exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
