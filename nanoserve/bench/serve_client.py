"""The load generator of `nanoserve bench serve`: a small asyncio HTTP/1.1 client that streams
/v1/completions and measures as vLLM's `bench serve` client does (TTFT at the first chunk with
non-empty `choices`, ITL between such chunks, output length from the final `usage`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.decode


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


class Connection:
    """One keep-alive connection; requests on it are sequential."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _ensure(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 20
            )

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass

    async def stream_completion(self, path: str, payload: dict, prompt_len: int) -> RequestResult:
        result = RequestResult(prompt_len=prompt_len)
        body = msgspec.json.encode(payload)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            await self._ensure()
            start = time.perf_counter()
            self.writer.write(head + body)
            await self._read_stream(result, start)
        except (OSError, asyncio.IncompleteReadError, ValueError) as error:
            result.ok = False
            result.error = result.error or f"{type(error).__name__}: {error}"
            await self.close()
            self.writer = None
        return result

    async def _read_stream(self, result: RequestResult, start: float) -> None:
        reader = self.reader
        status_and_headers = await reader.readuntil(b"\r\n\r\n")
        lines = status_and_headers.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        if headers.get("transfer-encoding") != "chunked":
            length = int(headers.get("content-length", "0"))
            data = await reader.readexactly(length)
            result.error = f"HTTP {status}: {data[:300]!r}"
            return
        if status != 200:
            result.error = f"HTTP {status}"
        pending = b""
        last = start
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            pending += data[:-2]
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    result.ok = not result.error
                    continue
                now = time.perf_counter()
                message = _decode(payload)
                if "error" in message:
                    result.error = str(message["error"].get("message"))
                    continue
                if message.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = message.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens") or 0
        result.latency = time.perf_counter() - start
        if headers.get("connection", "").lower() == "close":
            await self.close()
            self.writer = None


async def run_load(
    base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[RequestResult], float]:
    """Send every prompt with at most `concurrency` in flight; (results, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def worker() -> None:
        connection = Connection(base_url)
        try:
            while not queue.empty():
                prompt = queue.get_nowait()
                payload = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": output_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                results.append(
                    await connection.stream_completion("/v1/completions", payload, len(prompt))
                )
        finally:
            await connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return results, time.perf_counter() - start


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def percentile(q: float) -> float:  # linear interpolation, as numpy's default
        position = (len(ordered) - 1) * q
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {
        "mean": sum(ordered) / len(ordered) * scale,
        "median": percentile(0.5) * scale,
        "p99": percentile(0.99) * scale,
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _percentiles([r.ttft for r in done]),
        "tpot_ms": _percentiles(tpots),
        "itl_ms": _percentiles([gap for r in done for gap in r.itl]),
        "e2el_ms": _percentiles([r.latency for r in done]),
    }
