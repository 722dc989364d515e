"""Malformed LoRA adapters on a real server (issue 52 row 9): every bad adapter_config.json or
weights file is a 400 naming what is wrong, both through /v1/load_lora_adapter and when a request
names an adapter the engine has to read again; and the read runs on the engine's step thread,
never on the event loop (a spy on the real reader records the thread that ran it)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

# max_loras 1 (and so at most one adapter held): the second --lora-modules entry evicts the first,
# which a request then makes the engine read from disk again.
ENGINE = {
    "dtype": "float32",
    "enable_lora": True,
    "max_loras": 1,
    "device": "cpu",
    "num_kv_blocks": 64,
}
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def adapters(lora_adapters, tmp_path_factory):
    """Copies of two peft adapters this module may overwrite."""
    root = tmp_path_factory.mktemp("lora-copies")
    return {
        name: shutil.copytree(lora_adapters[source], root / name)
        for name, source in (("first", "all-r8"), ("second", "qv-down-r4-rslora"))
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        handle = ServerHandle(
            tiny_llama_dir,
            engine_kwargs=ENGINE,
            lora_modules=(
                ("first", str(adapters["first"]), None),
                ("second", str(adapters["second"]), None),
            ),
        )
    yield handle
    handle.close()


@pytest.fixture
def read_threads(monkeypatch):
    """The name of the thread each adapter read ran on (the real reader, wrapped)."""
    from nanoserve.lora import manager

    names: list[str] = []
    real = manager.read_adapter

    def spy(path, max_rank):
        names.append(threading.current_thread().name)
        return real(path, max_rank)

    monkeypatch.setattr(manager, "read_adapter", spy)
    return names


def _config(**changes) -> dict:
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none"}
    config.update(changes)
    return config


def _tensors(**changes) -> dict[str, torch.Tensor]:
    tensors = {
        f"{Q_PROJ}.lora_A.weight": torch.full((8, 64), 0.01),
        f"{Q_PROJ}.lora_B.weight": torch.full((64, 8), 0.01),
    }
    tensors.update(changes)
    return tensors


A, B = f"{Q_PROJ}.lora_A.weight", f"{Q_PROJ}.lora_B.weight"
# (config: a dict, or the file's raw bytes; tensors: a dict, or the file's raw bytes; message)
MALFORMED = {
    "config-list": (
        [_config()],
        _tensors(),
        "adapter_config.json must be a JSON object, got a list",
    ),
    "r-text": (_config(r="x"), _tensors(), "r must be a positive integer, got 'x'"),
    "r-zero": (_config(r=0), _tensors(), "r must be a positive integer, got 0"),
    "r-bool": (_config(r=True), _tensors(), "r must be a positive integer, got True"),
    "alpha-text": (_config(lora_alpha="y"), _tensors(), "lora_alpha must be a finite number"),
    "rslora-text": (_config(use_rslora="yes"), _tensors(), "use_rslora must be true or false"),
    "peft-type-number": (_config(peft_type=5), _tensors(), "peft_type must be a string"),
    "bias-list": (_config(bias=["all"]), _tensors(), "bias must be a string"),
    "rank-pattern-list": (_config(rank_pattern=[1]), _tensors(), "rank_pattern must be an object"),
    "rank-pattern-value": (
        _config(rank_pattern={"q_proj": "x"}),
        _tensors(),
        "rank_pattern['q_proj'] must be a positive integer",
    ),
    "alpha-pattern-regex": (
        _config(alpha_pattern={"(q_proj": 2}),
        _tensors(),
        "alpha_pattern key '(q_proj' is not a regular expression",
    ),
    "config-not-utf8": (b"\xff\xfe{", _tensors(), "adapter_config.json is not JSON"),
    "config-nested": (b"[" * 200_000, _tensors(), "adapter_config.json is not JSON"),
    "config-huge": (b" " * (2 << 20) + b"{}", _tensors(), "adapter_config.json is larger than"),
    "weights-garbage": (
        _config(),
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage",
        "adapter_model.safetensors can't be read",
    ),
    "weights-empty-file": (_config(), b"", "adapter_model.safetensors can't be read"),
    "weights-1d": (_config(), _tensors(**{A: torch.ones(8)}), f"{A} must be 2-D, got shape [8]"),
    "weights-int": (
        _config(),
        _tensors(**{A: torch.ones(8, 64, dtype=torch.int32)}),
        f"{A} has dtype I32, not a float type",
    ),
    "weights-rank-0": (
        _config(),
        _tensors(**{A: torch.ones(0, 64), B: torch.ones(64, 0)}),
        "has rank 0",
    ),
    "weights-nan": (
        _config(),
        _tensors(**{A: torch.full((8, 64), float("nan"))}),
        f"{A} holds NaN or infinite values",
    ),
    "weights-mismatch": (_config(), _tensors(**{B: torch.ones(64, 4)}), "do not fit together"),
    "weights-wrong-layer": (
        _config(),
        _tensors(**{A: torch.ones(8, 32)}),
        "do not fit the model's layer",
    ),
    "weights-b-only": (_config(), {B: torch.ones(64, 8)}, "has lora_B only"),
}


def _write(directory, config, tensors) -> str:
    directory.mkdir()
    config_file = directory / "adapter_config.json"
    config_file.write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    weights_file = directory / "adapter_model.safetensors"
    if isinstance(tensors, bytes):
        weights_file.write_bytes(tensors)
    else:
        save_file(tensors, str(weights_file))
    return str(directory)


def _post(server, path: str, body: dict) -> tuple[int, dict | str]:
    status, _, data = http_request(server.port, "POST", path, json.dumps(body))
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


def _complete(server, model: str) -> tuple[int, dict]:
    return _post(
        server,
        "/v1/completions",
        {"model": model, "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0},
    )


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_adapter_is_a_400_naming_the_problem(server, tmp_path, case):
    config, tensors, message = MALFORMED[case]
    path = _write(tmp_path / case, config, tensors)
    status, body = _post(server, "/v1/load_lora_adapter", {"lora_name": case, "lora_path": path})
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "BadRequestError" and message in error["message"], error
    assert path in error["message"]  # which adapter
    assert case not in {card["id"] for card in http_models(server)}


def http_models(server) -> list[dict]:
    status, _, data = http_request(server.port, "GET", "/v1/models")
    assert status == 200
    return json.loads(data)["data"]


def test_the_load_route_reads_on_the_step_thread(server, lora_adapters, read_threads):
    status, body = _post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "patterns", "lora_path": str(lora_adapters["patterns-r16"])},
    )
    assert status == 200, body
    loop_thread = server.loop_thread.thread.name
    assert len(read_threads) == 1 and read_threads[0] != loop_thread
    assert read_threads[0].startswith("engine-step")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "patterns"})[0] == 200


def test_a_request_reads_its_adapter_on_the_step_thread_and_a_bad_one_is_a_400(
    server, adapters, read_threads
):
    assert _complete(server, "second")[0] == 200
    read_threads.clear()
    # One adapter held at most: "first" is read from disk again, evicting "second".
    status, body = _complete(server, "first")
    assert status == 200 and body["model"] == "first", body
    assert [lora.lora_name for lora in server.engine.loras.values()] == ["first"]
    assert len(read_threads) == 1 and read_threads[0].startswith("engine-step")
    assert read_threads[0] != server.loop_thread.thread.name
    # "second", evicted, is changed on disk before a request names it again.
    (adapters["second"] / "adapter_config.json").write_text(json.dumps([{"r": 8}]))
    status, body = _complete(server, "second")
    assert status == 400, body
    assert body["error"]["type"] == "BadRequestError"
    assert "adapter_config.json must be a JSON object, got a list" in body["error"]["message"]
    assert len(read_threads) == 2 and read_threads[1].startswith("engine-step")
    status, body = _complete(server, "first")  # serving on
    assert status == 200 and body["model"] == "first", body
