"""Tensor parallelism through the HTTP server: real subprocess servers on real sockets."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from nanoserve import LLM, SamplingParams
from tests.distributed.ports import rendezvous_port
from tests.helpers import random_prompts


class ServerProcess:
    def __init__(
        self, *args: str, timeout: float = 180, wait_listening: bool = True, **popen
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoserve", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **popen,
        )
        self.log: list[str] = []  # the lines read so far
        self._lines: queue.Queue[str | None] = queue.Queue()  # None: end of output
        threading.Thread(target=self._read, daemon=True).start()  # no pipe fills up, no read hangs
        if wait_listening:
            self.url = self.read_until("listening on ", timeout).split()[-1]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read_until(self, text: str, timeout: float = 180) -> str:
        """Read the server's output (stdout and log) up to the first line that contains `text`;
        returns that line."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"no {text!r} within {timeout} s:\n" + "".join(self.log)
                ) from None
            if line is None:
                raise RuntimeError(f"server exited before {text!r}:\n" + "".join(self.log))
            self.log.append(line)
            if text in line:
                return line

    def exit(self, timeout: float) -> tuple[int, str]:
        """Wait for the server to exit: its exit code and all its output (the end of it comes
        once every process that shares its stdout, the ranks too, has gone)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            while not self._lines.empty() and (line := self._lines.get()) is not None:
                self.log.append(line)
            raise TimeoutError(
                f"the server did not exit within {timeout} s:\n" + "".join(self.log)
            ) from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    "the server's output did not end:\n" + "".join(self.log)
                ) from None
            if line is None:
                return code, "".join(self.log)
            self.log.append(line)

    def wait_for_workers(self, timeout: float = 120) -> list[int]:
        """Poll until the server has started its worker ranks (a state, not a delay)."""
        deadline = time.monotonic() + timeout
        while not (workers := self.children()):
            assert self.proc.poll() is None, "server exited before starting its ranks"
            assert time.monotonic() < deadline, "no worker rank started"
            time.sleep(0.01)
        return workers

    def completion(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        body = json.dumps(
            {
                "model": self.model_name(),
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            }
        ).encode()
        request = urllib.request.Request(
            self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        text = choice["text"]
        return text, choice["logprobs"]["tokens"]

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as response:
            return json.loads(response.read())["data"][0]["id"]

    def children(self) -> list[int]:
        """The worker ranks: child processes of any of the server's threads that run
        multiprocessing's spawn_main. Not the resource tracker, nor a child seen between its fork
        and its exec, whose command line is still the server's (the tracker's is, briefly: taken
        for a rank, it would have a test signal a start-up before any rank exists)."""
        pids = []
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                pids += [int(p) for p in children.read_text().split()]
            except FileNotFoundError:  # a thread that just ended
                pass
        workers = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except FileNotFoundError:  # a child that just ended
                continue
            if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
                workers.append(pid)
        return workers

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
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
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
    args = [
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--num-kv-blocks",
        "128",
    ]
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
    server = ServerProcess(
        "--model",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--tp",
        "3",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
    )
    try:
        assert [server.completion(p, 16)[0] for p in prompts] == expected
    finally:
        assert server.stop() == 0


def kill_workers_during_a_stream(server: ServerProcess, *, check_health: bool = False) -> None:
    """Kill every worker rank while a stream is open. The server must exit non-zero on its own
    (it reaps its ranks and learns of the death at once; the wait's bound is only a hang bound),
    the stream either breaks or ends with an error event and [DONE], no worker is left, and (with
    check_health) /health answers 503 in between, or the server is already gone."""
    workers = server.children()
    assert workers, "no worker process found"
    body = json.dumps(
        {
            "model": server.model_name(),
            "prompt": [5, 6, 7],
            "max_tokens": 500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: {")
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
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
    assert server.proc.wait(timeout=120) != 0
    if rest:  # a stream that did not just break ends with an error event and [DONE]
        assert b'"error"' in rest and rest.rstrip().endswith(b"data: [DONE]")
    assert not any(pid_alive(pid) for pid in workers)


def test_killed_worker_fails_requests_and_exits_nonzero(tiny_llama_dir):
    server = ServerProcess(
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "512",
    )
    try:
        kill_workers_during_a_stream(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_ctrl_c_stops_every_rank(tiny_llama_dir):
    server = ServerProcess(
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--tp", "2", "--num-kv-blocks", "64"
    )
    workers = server.children()
    assert workers
    server.proc.send_signal(signal.SIGINT)
    code, output = server.exit(timeout=60)
    assert code == 0, output[-3000:]
    alive = [
        (pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:80]) for pid in workers if pid_alive(pid)
    ]
    assert not alive  # stopped and joined, not left to die
    assert "parallel worker" not in output, (
        output
    )  # told to stop, not killed ("... died (exit code -9)")


def test_ctrl_c_to_the_process_group_while_ranks_start(tiny_llama_dir):
    """A terminal's Ctrl-C reaches every process of the group, the ranks too, at the moment the
    first rank exists (its interpreter starting, torch importing): rank 0 still stops them all and
    exits 0. The outcome may not depend on where start-up is when the signal lands."""
    server = ServerProcess(
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--num-kv-blocks",
        "64",
        wait_listening=False,
        start_new_session=True,
    )
    try:
        workers = server.wait_for_workers()
        os.killpg(server.proc.pid, signal.SIGINT)
        code, output = server.exit(timeout=120)
        assert code == 0, output[-3000:]
        assert not [pid for pid in workers if pid_alive(pid)]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def rendezvous_waiting_server(model_dir, port: int) -> tuple[ServerProcess, list[int], list[str]]:
    """Node 0 of two (--tp 4 --nnodes 2: ranks 0 and 1 here), which cannot finish starting until
    node 1 joins the rendezvous: a start-up that is certainly still under way."""
    common = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--tp",
        "4",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--num-kv-blocks",
        "64",
    ]
    server = ServerProcess(*common, "--node-rank", "0", wait_listening=False)
    return server, server.wait_for_workers(), common


def test_ctrl_c_during_start_up_stops_every_rank_without_serving(tiny_llama_dir):
    """SIGINT while rank 0 waits at the rendezvous: it is taken as a stop, start-up completes once
    the other node joins, and then every rank of both nodes is stopped and joined; exit 0, and the
    server never listens."""
    server, workers, common = rendezvous_waiting_server(tiny_llama_dir, rendezvous_port())
    node1 = None
    try:
        server.proc.send_signal(signal.SIGINT)
        server.read_until("SIGINT during start-up: stopping without serving", timeout=60)
        node1 = subprocess.Popen(
            [sys.executable, "-m", "nanoserve", "serve", *common, "--node-rank", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        code, output = server.exit(timeout=120)
        assert code == 0, output[-3000:]
        assert "listening on" not in output
        assert not [pid for pid in workers if pid_alive(pid)]
        node1_output, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, node1_output[-3000:]  # rank 0 stopped node 1's ranks too
    finally:
        for process in (server.proc, node1):
            if process is not None and process.poll() is None:
                process.kill()


def test_second_ctrl_c_during_start_up_kills_every_rank(tiny_llama_dir):
    """A start-up that cannot finish (the other node never comes): the first SIGINT waits for it,
    the second kills this node's ranks, reaps them and exits 130 at once."""
    server, workers, _ = rendezvous_waiting_server(tiny_llama_dir, rendezvous_port())
    try:
        server.proc.send_signal(signal.SIGINT)
        server.read_until("SIGINT during start-up: stopping without serving", timeout=60)
        server.proc.send_signal(signal.SIGINT)
        code, output = server.exit(timeout=60)
        assert code == 130, output[-3000:]
        assert "killing the worker ranks" in output
        assert not [pid for pid in workers if pid_alive(pid)]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
