"""Tensor parallelism through the HTTP server: real subprocess servers on real sockets."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.test_engine_tiny import random_prompts


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 180) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        self.log: list[str] = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before listening:\n" + "".join(self.log))
            self.log.append(line)
            if line.startswith("listening on "):
                self.url = line.split()[-1]
                break
            if time.monotonic() > deadline:
                raise TimeoutError("".join(self.log))

    def completion(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        body = json.dumps({"model": self.model_name(), "prompt": prompt_ids, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "logprobs": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        text = choice["text"]
        return text, choice["logprobs"]["tokens"]

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as response:
            return json.loads(response.read())["data"][0]["id"]

    def children(self) -> list[int]:
        """Child processes of any of the server's threads, except multiprocessing's resource tracker."""
        pids = []
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            pids += [int(p) for p in children.read_text().split()]
        return [p for p in pids if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def offline_texts(model_dir, prompts, max_tokens, **engine_args):
    with LLM(model=str(model_dir), dtype="float32", **engine_args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].text for o in outs]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_two_tp2_servers_side_by_side_match_tp1(tiny_llama_dir):
    prompts = random_prompts(3, 300, seed=31)
    expected = offline_texts(tiny_llama_dir, prompts, 12, num_kv_blocks=128)
    args = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--tp", "2", "--num-kv-blocks", "128"]
    first, second = ServerProcess(*args), ServerProcess(*args)
    try:
        assert first.url != second.url
        for server in (first, second):
            assert [server.completion(p, 12)[0] for p in prompts] == expected
            assert len(server.children()) >= 1  # the rank-1 worker
    finally:
        codes = [first.stop(), second.stop()]
    assert codes == [0, 0]


def test_tp3_smollm2_server_matches_tp1(smollm2_dir):
    tokenizer_prompts = ["The capital of France is", "def fibonacci(n):"]
    with LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=64, max_model_len=512) as llm:
        prompts = [llm.get_tokenizer().encode(p) for p in tokenizer_prompts]
    expected = offline_texts(smollm2_dir, prompts, 16, num_kv_blocks=64, max_model_len=512)
    server = ServerProcess("--model", str(smollm2_dir), "--dtype", "float32", "--tp", "3",
                           "--num-kv-blocks", "64", "--max-model-len", "512")
    try:
        assert [server.completion(p, 16)[0] for p in prompts] == expected
    finally:
        assert server.stop() == 0


def kill_workers_during_a_stream(server: ServerProcess, *, check_health: bool = False) -> None:
    """Kill every worker rank while a stream is open. The server must exit non-zero within 30 s,
    the stream either breaks or ends with an error event and [DONE], no worker is left, and (with
    check_health) /health answers 503 in between, or the server is already gone."""
    workers = server.children()
    assert workers, "no worker process found"
    body = json.dumps({"model": server.model_name(), "prompt": [5, 6, 7], "max_tokens": 500,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: {")
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rest = b""
    try:
        rest = response.read()
    except Exception:  # the connection may be cut instead of ending the stream
        pass
    if check_health:
        health = None
        try:
            urllib.request.urlopen(server.url + "/health", timeout=5)
            health = 200
        except urllib.error.HTTPError as error:
            health = error.code
        except OSError:  # already gone
            pass
        assert health in (503, None), health
    assert server.proc.wait(timeout=30) != 0
    assert time.monotonic() - killed_at < 30
    if rest:  # a stream that did not just break ends with an error event and [DONE]
        assert b'"error"' in rest and rest.rstrip().endswith(b"data: [DONE]")
    assert not any(pid_alive(pid) for pid in workers)


def test_killed_worker_fails_requests_and_exits_nonzero(tiny_llama_dir):
    server = ServerProcess("--model", str(tiny_llama_dir), "--dtype", "float32", "--tp", "2",
                           "--num-kv-blocks", "128", "--max-model-len", "512")
    try:
        kill_workers_during_a_stream(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_ctrl_c_stops_every_rank(tiny_llama_dir):
    server = ServerProcess("--model", str(tiny_llama_dir), "--dtype", "float32", "--tp", "2",
                           "--num-kv-blocks", "64")
    workers = server.children()
    assert workers
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0
    alive = [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:80]) for pid in workers if pid_alive(pid)]
    assert not alive  # stopped and joined, not left to die
