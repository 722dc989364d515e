"""`python -m nanoserve serve` in a subprocess: port 0, graceful shutdown on SIGTERM / SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.server.server_helpers import connect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(model_dir, *extra: str) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith("listening on http://"):
            return process, int(line.strip().rsplit(":", 1)[1])
    process.kill()
    raise AssertionError(f"server did not start: {process.stderr.read()}")


def open_stream(port: int, max_tokens: int):
    sock = connect(port, timeout=30)
    payload = json.dumps(
        {
            "prompt": "hello",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    data = b""
    while b"data: " not in data:
        data += sock.recv(65536)
    return sock, data


def wait_refused(port: int) -> None:
    """Connect until the server refuses: its listener is closed (a state, polled; the bound only
    keeps a server that never closes it from hanging the suite)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            connect(port, timeout=30).close()
        except ConnectionRefusedError:
            return
        except ConnectionResetError:
            pass  # the listener closed with this connection pending in its backlog: poll again
        assert time.monotonic() < deadline, "the server kept accepting connections"
        time.sleep(0.01)


def read_all(sock) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_lets_streams_finish(tiny_llama_dir, signum):
    process, port = start(tiny_llama_dir, "--shutdown-grace-period", "60")
    try:
        sock, head = open_stream(port, 300)
        process.send_signal(signum)
        wait_refused(port)  # no new connections, while the open stream goes on to its end
        body = head + read_all(sock)
        assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        usage = [
            json.loads(line[6:])
            for line in body.decode("utf-8", "replace").split("\r\n")
            if line.startswith('data: {"id"') and '"usage"' in line
        ]
        assert usage and usage[-1]["usage"]["completion_tokens"] == 300
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_grace_period_expiry_aborts_and_exits_zero(long_context_llama_dir):
    # A grace period far shorter than the 4,000 steps the stream needs (at least ~1 ms each, and
    # the grace period is over after one poll of the server's connections, ~20 ms).
    process, port = start(long_context_llama_dir, "--shutdown-grace-period", "0.001")
    try:
        sock, head = open_stream(port, 4000)
        process.send_signal(signal.SIGTERM)
        body = head + read_all(sock)
        # Cut short by the shutdown, with word of it: an error event, then [DONE] (issue 15).
        assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert b"shutting down" in body and body.count(b'"text_completion"') < 4000
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def assert_served_as_offline(path, quantization: str, qtype: str) -> None:
    """A quantized checkpoint of the default model (tests/server/test_compressed_tensors_server.py,
    test_gptq_awq_server.py, test_fp8_server.py): offline, its layers hold `qtype` blocks (no float copy) and it still
    answers " Paris"; `nanoserve serve` on it gives the openai client the offline engine's greedy
    text, and a chat completion answers."""
    import openai

    from nanoserve import LLM, SamplingParams

    prompt = "The capital of France is"
    with LLM(model=str(path), dtype="float32", max_model_len=512, device="cpu") as llm:
        layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.weight_form.parts[0].qtype == qtype and layer.weight.device.type == "meta"
        offline = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
        )[0]
    offline_text = offline.outputs[0].text
    assert offline_text.startswith(" Paris")  # the quantized weights keep the model's answer

    process, port = start(
        path,
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--quantization",
        quantization,
    )
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300
        )
        [model] = [m.id for m in client.models.list().data]
        result = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert result.choices[0].text == offline_text
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
