"""SIGINT and SIGTERM for the whole of `nanoserve serve`, from before torch is imported until the
tensor- / pipeline-parallel worker ranks are stopped and joined. Light on purpose: `cmd_serve`
installs it before importing the server, so no import may pull torch in here."""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger("nanoserve.server")


class ShutdownSignals:
    """The one owner of SIGINT and SIGTERM while `serve` runs: installed before the engine, and so
    before any worker rank, exists, and restored once the ranks have been stopped and joined. No
    signal is ever a KeyboardInterrupt here, and asyncio.Runner installs no SIGINT handler of its
    own (it does only over Python's default one), so none can cancel `serve` half-way.

    The first signal asks for a graceful stop: while serving, in-flight requests get the grace
    period; during start-up, the engine is shut down as soon as it is built (its ranks stopped and
    joined as after serving), without serving. Each later one while the HTTP server is serving
    or draining aborts the in-flight requests. A later one while it is not (start-up, where a rank
    may be stuck in a rendezvous, or stopping the ranks) kills every rank this process started
    and exits 130 at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self.serving = False  # `serve`: from listening until the HTTP server has shut down
        self._loop = None
        self._callback = None
        self._forcing = False
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def listen(self, loop, callback) -> None:
        """Call on `loop`: from now on `callback(signum, count)` runs there for each signal; one
        that came before is delivered now, before this returns."""
        self._loop, self._callback = loop, callback
        if self.count:
            callback(self.first, self.count)

    def stop_listening(self) -> None:
        self._loop = self._callback = None

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)

    def _handle(self, signum: int, frame) -> None:  # on the main thread, between two bytecodes
        self.count += 1
        if self.count == 1:
            self.first = signum
        if self.count >= 2 and not self.serving:
            self._force(signum)
        loop, callback = self._loop, self._callback
        if loop is not None:
            try:
                loop.call_soon_threadsafe(callback, signum, self.count)
            except RuntimeError:  # the loop is closed: what it ran is over
                pass

    def _force(self, signum: int) -> None:
        if self._forcing:  # one more signal while the first forced exit is under way
            return
        self._forcing = True
        try:
            logger.warning(
                "%s again: killing the worker ranks and exiting now", signal.Signals(signum).name
            )
        except Exception:  # the main thread was inside a write to the same stream
            pass
        try:
            launcher = sys.modules.get("nanoserve.distributed.launcher")
            if launcher is not None:  # not imported yet: no rank exists
                launcher.kill_every_rank()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(130)
