"""Tokenizing and chat-template rendering off the event loop, on a bounded pool of threads.

Small inputs run inline (a thread hop costs more than the work). Larger ones run on the pool;
at most `max_in_flight` may be queued or running (503 beyond that), and a caller waits at most
`timeout` seconds (400 after that: the input takes too long to prepare). A worker thread cannot
be stopped, so a late job keeps its slot until it really ends; template rendering also checks
the same deadline itself and stops.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nanoserve.server.schemas import APIError

SMALL_INPUT = 4096  # characters: below this, tokenize / render on the loop


class Preprocessor:
    def __init__(self, threads: int, timeout: float, max_in_flight: int) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="preprocess")
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def deadline(self) -> float:
        """For work that can stop itself (template rendering): time.monotonic() to stop by."""
        return time.monotonic() + self.timeout

    async def run(
        self,
        size: int,
        fn: Callable[..., Any],
        *args: Any,
        prepare_by: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """`prepare_by` (time.monotonic()): for a job that is one of several of one request,
        the time the whole request must be prepared by (`deadline()` taken before the first)."""
        if size < SMALL_INPUT:
            return fn(*args, **kwargs)
        timeout = self.timeout if prepare_by is None else prepare_by - time.monotonic()
        if self.in_flight >= self.max_in_flight:
            raise APIError(
                503,
                f"The server is busy preparing {self.in_flight} large inputs. Retry later.",
                headers=[("retry-after", "1")],
            )
        self.in_flight += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))
        future.add_done_callback(self._job_done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(timeout, 0.0))
        except TimeoutError:
            raise APIError(
                400,
                f"The input took longer than {self.timeout:g} s to prepare "
                "(tokenize or render); send a shorter one.",
            ) from None

    def _job_done(self, future: asyncio.Future) -> None:
        self.in_flight -= 1
        if not future.cancelled():
            future.exception()  # retrieved here when its caller gave up waiting

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
