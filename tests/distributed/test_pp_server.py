"""Pipeline parallelism through the HTTP server (real subprocess servers on real sockets): --pp 2
serves pp=1's tokens; a killed stage fails the in-flight stream and the server exits non-zero."""

from __future__ import annotations

from tests.distributed.test_tp_server import (
    ServerProcess,
    kill_workers_during_a_stream,
    offline_texts,
)
from tests.helpers import random_prompts


def test_pp2_server_matches_pp1_then_a_killed_stage_fails_it(tiny_llama_dir):
    prompts = random_prompts(2, 300, seed=31)
    expected = offline_texts(tiny_llama_dir, prompts, 12, num_kv_blocks=128)
    server = ServerProcess(
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--pp",
        "2",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "512",
        "--cpu-threads",
        "1",
    )
    try:
        assert [server.completion(p, 12)[0] for p in prompts] == expected
        kill_workers_during_a_stream(server, check_health=True)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
