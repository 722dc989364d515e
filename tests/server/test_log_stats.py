"""vLLM's periodic engine stats line (on by default, --disable-log-stats turns it off) and its
request log (--enable-log-requests, --max-log-len), on real servers with the log captured."""

from __future__ import annotations

import logging
import re
import time

import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy

INTERVAL = 0.3  # $VLLM_LOG_STATS_INTERVAL for these tests (vLLM's default is 10 s)
STATS_LINE = re.compile(
    r"^Engine 000: Avg prompt throughput: (\d+\.\d) tokens/s, "
    r"Avg generation throughput: (\d+\.\d) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
    r"(?:Preemptions: \d+, )?GPU KV cache usage: (\d+\.\d)%, Prefix cache hit rate: (\d+\.\d)%$"
)


def stats_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "nanoserve.stats"]


def parsed(record: logging.LogRecord) -> tuple[float, float, int, int, float, float]:
    match = STATS_LINE.match(record.getMessage())
    assert match, record.getMessage()
    prompt, generation, running, waiting, kv, hit = match.groups()
    return float(prompt), float(generation), int(running), int(waiting), float(kv), float(hit)


@pytest.fixture
def short_interval(monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", str(INTERVAL))


def busy_line_while_held(handle: ServerHandle, busy_line):
    """Steps one at a time until the stats snapshot shows two running and two waiting, then lets
    one more step run and holds the next: the first stats line after that step has its tokens and
    that state, however fast 480 tokens go here (no race between the interval and the requests)."""
    spy = StepSpy(handle.engine)
    stats = handle.server.engine  # the async engine: its snapshot is what the line prints
    try:
        step = spy.wait_for_next_step(seen=spy.hold_next_step())
        for _ in range(480):  # each request has 480 tokens to go: the state comes before that
            if (stats.stats.num_running, stats.stats.num_waiting) == (2, 2):
                break
            held = spy.hold_next_step()
            spy.release(step)
            step = spy.wait_for_next_step(seen=held)
        else:
            raise AssertionError("the engine never ran two requests with two waiting")
        held = spy.hold_next_step()
        spy.release(step)  # its tokens are in the snapshot before the next step begins
        step = spy.wait_for_next_step(seen=held)
        try:
            return wait_until(busy_line)
        finally:
            spy.release(step)
    finally:
        spy.restore()


def test_stats_line_while_busy_then_quiet_when_idle(tiny_llama_dir, short_interval, caplog):
    caplog.set_level(logging.DEBUG, logger="nanoserve.stats")
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 128, "max_num_seqs": 2})
    streams = []
    try:
        assert handle.engine.config.disable_log_stats is False  # vllm serve's default
        client = handle.client()
        for index in range(4):  # two run, two wait: max_num_seqs=2
            streams.append(
                client.completions.create(
                    model=handle.engine.served_model_name,
                    prompt=[5 + index] * 20,
                    max_tokens=480,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )

        def busy_line():
            for record in stats_records(caplog):
                values = parsed(record)
                if values[2:4] == (2, 2) and values[1] > 0:
                    return record, values
            return None

        record, (_, generation, _, _, kv_usage, hit_rate) = busy_line_while_held(handle, busy_line)
        assert record.levelno == logging.INFO and generation > 0
        assert 0 < kv_usage <= 100 and 0 <= hit_rate <= 100
        for stream in streams:
            stream.close()  # the disconnects abort the requests
        async_engine = handle.server.engine
        wait_until(lambda: async_engine.stats.num_running == async_engine.stats.num_waiting == 0)

        # vLLM's rule: a line whose interval and the one before moved no tokens is DEBUG.
        def idle_lines(count: int):
            records = stats_records(caplog)
            tail = records[-count:]
            if len(tail) == count and all(r.levelno == logging.DEBUG for r in tail):
                return records
            return None

        records = wait_until(lambda: idle_lines(2))
        num_info = sum(r.levelno == logging.INFO for r in records)
        num_lines = len(records)
        wait_until(lambda: len(stats_records(caplog)) >= num_lines + 3)  # three more intervals
        later = stats_records(caplog)[num_lines:]
        assert all(r.levelno == logging.DEBUG for r in later)
        assert sum(r.levelno == logging.INFO for r in stats_records(caplog)) == num_info
        assert all(parsed(r)[:4] == (0.0, 0.0, 0, 0) for r in later)
        assert parsed(later[-1])[4] == 0.0  # every block freed
    finally:
        for stream in streams:
            stream.close()
        handle.close()


def test_disable_log_stats_logs_nothing(tiny_llama_dir, short_interval, caplog):
    caplog.set_level(logging.DEBUG, logger="nanoserve.stats")
    handle = ServerHandle(
        tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64, "disable_log_stats": True}
    )
    try:
        assert handle.server.engine.stat_logger is None
        client = handle.client()
        reply = client.completions.create(
            model=handle.engine.served_model_name,
            prompt="hi",
            max_tokens=30,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 30
        # an absence: give it several intervals in which a line would have come
        deadline = time.monotonic() + 4 * INTERVAL
        while time.monotonic() < deadline:
            assert not stats_records(caplog)
            time.sleep(0.05)
    finally:
        handle.close()


def test_offline_llm_keeps_quiet_unless_asked(tiny_llama_dir, monkeypatch, caplog):
    from nanoserve import LLM, SamplingParams

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.001")  # shorter than the run below
    caplog.set_level(logging.DEBUG, logger="nanoserve.stats")
    quiet = LLM(model=str(tiny_llama_dir), num_kv_blocks=64)
    assert quiet.llm_engine.config.disable_log_stats is True and quiet.stat_logger is None
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    start = time.monotonic()
    quiet.generate([[5] * 10], params, use_tqdm=False)
    assert time.monotonic() - start > 0.001 and stats_records(caplog) == []
    loud = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, disable_log_stats=False)
    loud.generate([[5] * 10], params, use_tqdm=False)
    records = stats_records(caplog)
    assert records and all(r.levelno == logging.INFO for r in records)
    assert sum(parsed(r)[1] for r in records) > 0 and parsed(records[0])[2] == 1


def test_request_log_has_id_length_and_params_but_no_prompt(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="nanoserve.requests")
    handle = ServerHandle(
        tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64}, enable_log_requests=True
    )
    try:
        client = handle.client()
        prompt = "The quick brown fox"
        num_tokens = len(handle.engine.tokenizer.encode(prompt))
        reply = client.completions.create(
            model=handle.engine.served_model_name, prompt=prompt, max_tokens=3, temperature=0.5
        )
        chat = client.chat.completions.create(
            model=handle.engine.served_model_name,
            max_tokens=2,
            messages=[{"role": "user", "content": prompt}],
        )
        lines = [r.getMessage() for r in caplog.records if r.name == "nanoserve.requests"]
        assert len(lines) == 2
        assert lines[0].startswith(
            f"Received request {reply.id}: prompt_token_ids_len: "
            f"{num_tokens}, priority: 0, params: SamplingParams("
        )
        assert "max_tokens=3" in lines[0] and "temperature=0.5" in lines[0]
        assert lines[1].startswith(
            f"Received request {chat.id}: prompt_token_ids_len: {chat.usage.prompt_tokens}, "
        )
        assert all(prompt not in line and "quick" not in line for line in lines)
    finally:
        handle.close()


def test_request_log_off_by_default_and_prompt_only_at_debug_cut_to_max_log_len(
    tiny_llama_dir, caplog
):
    caplog.set_level(logging.DEBUG, logger="nanoserve.requests")
    prompt = "The quick brown fox"
    for options, expect in (({}, False), ({"enable_log_requests": True, "max_log_len": 7}, True)):
        caplog.clear()
        handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 64}, **options)
        try:
            ids = handle.engine.tokenizer.encode(prompt)
            reply = handle.client().completions.create(
                model=handle.engine.served_model_name, prompt=prompt, max_tokens=2
            )
            records = [r for r in caplog.records if r.name == "nanoserve.requests"]
            if not expect:
                assert records == []
                continue
            details = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
            assert details == [
                f"Request {reply.id} details: prompt: {prompt[:7]!r}, prompt_token_ids: {ids[:7]}."
            ]
            assert prompt not in details[0]
        finally:
            handle.close()


def test_max_log_len_must_not_be_negative():
    from nanoserve.cli import build_parser
    from nanoserve.server.args import options_from_args

    args = build_parser().parse_args(["serve", "--enable-log-requests", "--max-log-len", "12"])
    options = options_from_args(args)
    assert options.enable_log_requests is True and options.max_log_len == 12
    assert options_from_args(build_parser().parse_args(["serve"])).max_log_len is None
    with pytest.raises(ValueError, match="--max-log-len must be >= 0, got -1"):
        options_from_args(build_parser().parse_args(["serve", "--max-log-len", "-1"]))


def test_serve_command_logs_stats_and_requests_on_stderr(tiny_llama_dir, tmp_path):
    """`nanoserve serve` as users run it: the stats line is on without any flag."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.server.server_helpers import http_request

    stderr_path = tmp_path / "stderr.log"
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": str(INTERVAL)}
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nanoserve",
                "serve",
                "--model",
                str(tiny_llama_dir),
                "--port",
                "0",
                "--num-kv-blocks",
                "64",
                "--enable-log-requests",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    try:
        line = wait_until(
            lambda: process.stdout.readline() or process.poll() is not None, timeout=120
        )
        assert isinstance(line, str) and line.startswith("listening on http://"), line
        port = int(line.strip().rsplit(":", 1)[1])
        body = json.dumps({"prompt": "secret prompt", "max_tokens": 200, "ignore_eos": True})
        status, _, reply = http_request(port, "POST", "/v1/completions", body)
        assert status == 200
        request_id = json.loads(reply)["id"]
        text = wait_until(lambda: (t := stderr_path.read_text()) and " Engine 000: " in t and t)
        assert f"Received request {request_id}: prompt_token_ids_len: " in text
        assert "secret" not in text
        stats = [x for x in text.splitlines() if "nanoserve.stats" in x]
        assert STATS_LINE.match(stats[0].split("nanoserve.stats: ", 1)[1])
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
