"""--scheduling-policy over HTTP: fcfs refuses a non-zero priority with vLLM's 400; priority
serves the lowest value first."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy


def test_fcfs_refuses_a_priority_with_vllms_400(tiny_server):
    client = tiny_server.client()
    model = tiny_server.engine.served_model_name
    assert tiny_server.engine.config.scheduling_policy == "fcfs"
    for create in (
        lambda: client.completions.create(
            model=model, prompt="hi", max_tokens=2, extra_body={"priority": 1}
        ),
        lambda: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"priority": -2},
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create()
        assert caught.value.status_code == 400
        error = caught.value.body
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert error["message"] in (
            "Got priority 1 but Priority scheduling is not enabled.",
            "Got priority -2 but Priority scheduling is not enabled.",
        )
    # priority 0 is every request's default and stays accepted; the server serves on
    reply = client.completions.create(
        model=model, prompt="hi", max_tokens=2, extra_body={"priority": 0}
    )
    assert reply.usage.completion_tokens == 2
    assert tiny_server.server.engine.stats.num_waiting == 0


def test_priority_policy_serves_the_lowest_value_first(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={"num_kv_blocks": 128, "max_num_seqs": 1, "scheduling_policy": "priority"},
    )
    try:
        client = handle.client()
        model = handle.engine.served_model_name
        # One request holds the only sequence slot while the others queue behind it.
        blocker = client.completions.create(
            model=model, prompt="hold", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(blocker))
        finished: list[str] = []

        def send(name: str, priority: int) -> None:
            client.completions.create(
                model=model,
                prompt=name,
                max_tokens=20,
                extra_body={"ignore_eos": True, "priority": priority},
            )
            finished.append(name)

        async_engine = handle.server.engine
        threads = []
        # A step stays running while the others are sent, so the blocker certainly still holds
        # the slot when they queue, however fast its 480 tokens would otherwise go.
        spy = StepSpy(handle.engine)
        step = spy.wait_for_next_step(seen=spy.hold_next_step())
        try:
            for name, priority in (("late-low", 5), ("zero", 0), ("urgent", -3), ("low", 5)):
                thread = threading.Thread(target=send, args=(name, priority))
                thread.start()
                threads.append(thread)
                # each one is queued before the next is sent: arrival order is known
                wait_until(lambda: async_engine.num_waiting == len(threads))
        finally:
            spy.release(step)
        blocker.close()  # the disconnect aborts it: the slot frees
        for thread in threads:
            thread.join(120)
        assert finished == ["urgent", "zero", "late-low", "low"]
    finally:
        handle.close()
