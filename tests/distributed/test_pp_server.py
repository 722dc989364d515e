"""Pipeline parallelism through the HTTP server (real subprocess servers on real sockets): --pp 2
serves pp=1's tokens; a killed stage fails the in-flight stream and the server exits non-zero."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

from tests.distributed.test_tp_server import ServerProcess, offline_texts, pid_alive
from tests.engine.test_engine_tiny import random_prompts


def test_pp2_server_matches_pp1_then_a_killed_stage_fails_it(tiny_llama_dir):
    prompts = random_prompts(2, 300, seed=31)
    expected = offline_texts(tiny_llama_dir, prompts, 12, num_kv_blocks=128)
    server = ServerProcess("--model", str(tiny_llama_dir), "--dtype", "float32", "--pp", "2",
                           "--num-kv-blocks", "128", "--max-model-len", "512", "--cpu-threads", "1")
    try:
        assert [server.completion(p, 12)[0] for p in prompts] == expected
        workers = server.children()
        assert workers, "no stage-1 process found"
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
        health = None
        try:
            urllib.request.urlopen(server.url + "/health", timeout=5)
            health = 200
        except urllib.error.HTTPError as error:
            health = error.code
        except OSError:  # already gone
            pass
        print(f"\n/health after the kill: {health}")
        assert health in (503, None)
        assert server.proc.wait(timeout=30) != 0
        assert time.monotonic() - killed_at < 30
        if rest:  # a stream that did not just break ends with an error event and [DONE]
            assert b'"error"' in rest and rest.rstrip().endswith(b"data: [DONE]")
        assert not any(pid_alive(pid) for pid in workers)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
