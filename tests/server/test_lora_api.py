"""LoRA adapters through the server (--enable-lora --lora-modules), with the official openai
client: a request names an adapter as its model and gets what LLM.generate gives with that
adapter; /v1/models lists them; runtime loading and unloading (VLLM_ALLOW_RUNTIME_LORA_UPDATING);
clear errors for an unknown model and for a bad adapter, the server serving on."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from nanoserve import LLM, LoRARequest, SamplingParams
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.server.test_cli_server import ROOT

PROMPT = "def add(a, b):"
ENGINE = {
    "dtype": "float32",
    "enable_lora": True,
    "max_loras": 2,
    "device": "cpu",
    "num_kv_blocks": 256,
}


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir, lora_adapters, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs=ENGINE,
        lora_modules=(
            ("sql", str(lora_adapters["all-r8"]), None),
            ("short", str(lora_adapters["qv-down-r4-rslora"]), "base-alias"),
        ),
    )
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, lora_adapters):
    """LLM.generate's greedy text for the prompt, per adapter name (None: the base model)."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    names = [None, "all-r8", "qv-down-r4-rslora", "patterns-r16"]
    with LLM(model=str(tiny_llama_dir), **ENGINE) as llm:
        outputs = llm.generate(
            [PROMPT] * len(names),
            params,
            use_tqdm=False,
            lora_request=[
                LoRARequest(n, i, str(lora_adapters[n])) if n else None for i, n in enumerate(names)
            ],
        )
    return {name: output.outputs[0].text for name, output in zip(names, outputs)}


def complete(client, model: str, stream: bool = False):
    return client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )


def test_adapters_are_models(lora_server, offline, tiny_llama_dir):
    client = lora_server.client()
    base = lora_server.engine.served_model_name
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {base, "sql", "short"}
    assert cards["sql"].root.endswith("all-r8") and cards["sql"].parent == base
    assert cards["short"].parent == "base-alias" and client.models.retrieve("short").id == "short"
    assert len({offline[None], offline["all-r8"], offline["qv-down-r4-rslora"]}) == 3
    for model, adapter in [(base, None), ("sql", "all-r8"), ("short", "qv-down-r4-rslora")]:
        response = complete(client, model)
        assert response.model == model and response.choices[0].text == offline[adapter]
        chunks = list(complete(client, model, stream=True))
        assert {chunk.model for chunk in chunks} == {model}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == offline[adapter]
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0
    )
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        complete(client, "nope")


def test_runtime_load_and_unload(lora_server, offline, lora_adapters, tmp_path):
    client, port = lora_server.client(), lora_server.port

    def post(path: str, body: dict):
        status, _, data = http_request(port, "POST", path, json.dumps(body))
        return status, data.decode()

    status, text = post(
        "/v1/load_lora_adapter",
        {"lora_name": "patterns", "lora_path": str(lora_adapters["patterns-r16"])},
    )
    assert (status, text) == (200, "Success: LoRA adapter 'patterns' added successfully.")
    assert complete(client, "patterns").choices[0].text == offline["patterns-r16"]
    status, text = post(
        "/v1/load_lora_adapter",
        {"lora_name": "patterns", "lora_path": str(lora_adapters["all-r8"])},
    )
    assert status == 400 and "has already been loaded" in json.loads(text)["error"]["message"]
    status, text = post(
        "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path)}
    )
    assert status == 400 and "no adapter_config.json" in json.loads(text)["error"]["message"]
    status, text = post(
        "/v1/load_lora_adapter",
        {"lora_name": "patterns", "lora_path": str(lora_adapters["all-r8"]), "load_inplace": True},
    )
    assert status == 200 and complete(client, "patterns").choices[0].text == offline["all-r8"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "patterns"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "patterns")
    status, text = post("/v1/unload_lora_adapter", {"lora_name": "patterns"})
    assert status == 404 and "cannot be found" in json.loads(text)["error"]["message"]
    assert "patterns" not in {card.id for card in client.models.list().data}
    assert complete(client, "sql").choices[0].text == offline["all-r8"]  # serving on


def test_runtime_routes_need_the_variable(tiny_llama_dir, lora_adapters, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs=ENGINE,
        lora_modules=(("sql", str(lora_adapters["all-r8"]), None),),
    )
    try:
        status, _, _ = http_request(
            handle.port,
            "POST",
            "/v1/load_lora_adapter",
            json.dumps({"lora_name": "x", "lora_path": str(lora_adapters["all-r8"])}),
        )
        assert status == 404
    finally:
        handle.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora-modules", "a=/nowhere"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "'a' is not name=path"),
        (["--enable-lora", "--lora-modules", "a=/nowhere"], "no adapter_config.json"),
    ],
)
def test_cli_refuses_bad_lora_modules(tiny_llama_dir, args, message):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "serve",
            "--model",
            str(tiny_llama_dir),
            "--port",
            "0",
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "64",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert message in lines[-1] and not any(line.startswith("Traceback") for line in lines)


def test_metrics_and_response_cache_know_the_adapter(tiny_llama_dir, lora_adapters):
    """/metrics names the served adapters' requests (vllm:lora_requests_info); the response
    cache keeps an adapter's answers apart from the base model's for the same request."""
    from tests.server.server_helpers import scrape_metrics

    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs=ENGINE,
        response_cache_size=1.0,
        lora_modules=(("sql", str(lora_adapters["all-r8"]), None),),
    )
    try:
        client = handle.client()
        base = handle.engine.served_model_name
        first = [complete(client, model).choices[0].text for model in (base, "sql")]
        again = [complete(client, model).choices[0].text for model in (base, "sql")]
        assert first == again and first[0] != first[1]
        status, _, body = http_request(handle.port, "GET", "/metrics")
        lines = [
            line
            for line in body.decode().splitlines()
            if line.startswith("vllm:lora_requests_info{")
        ]
        assert status == 200 and len(lines) == 1 and 'max_lora="2"' in lines[0]
        assert scrape_metrics(handle.port)["nanoserve:response_cache_hits_total"] == 2
    finally:
        handle.close()
