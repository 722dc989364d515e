"""Each piece of per-request state has one owner (issue 53): which engine modules may change which
field of the scheduler's Sequence and its speculative Proposal, the engine's Request and the
output processor's OutputState.

Read from the source: an assignment, augmented assignment or `del` on `receiver.field` (or an
item of it), a mutating call on it (`seq.token_ids.append(...)`), or a call of one of the class's
own methods (`request.record_tokens(...)`), where the receiver's name says its class (`seq`,
`request`, `state`, ...; test_the_receiver_names_hold checks the annotations keep to it). A module
that starts writing a field not listed for it here fails: give the field an owner instead, or
widen the list on purpose. A class's writes to `self` are its own business.

Below the engine core, the model runner, the sampler's batch and the verification get a step's
frozen inputs (engine/step_input.py), not the live sequences: they cannot import, even through
another module, anything that holds the scheduler's or the output processor's state."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from nanoserve.engine.output_state import OutputState
from nanoserve.engine.request import Request
from nanoserve.engine.sequence import Proposal, Sequence
from nanoserve.engine.step_input import SamplingInput, SeqInput
from nanoserve.sampling_params import SamplingParams
from tests.test_import_graph import imported_modules, module_names

ENGINE = Path(__file__).resolve().parents[2] / "nanoserve" / "engine"

# The names a value of each class goes by in the engine.
RECEIVERS = {
    "seq": Sequence,
    "seqs": Sequence,
    "shadow": Sequence,  # spec_decode/draft.py's copy of a sequence for the draft model
    "proposal": Proposal,
    "request": Request,
    "requests": Request,  # the engine's table: self.requests[request_id]
    "state": OutputState,
}

# class -> field (or mutating method) -> the engine modules that may change it from outside.
ALLOWED_WRITERS: dict[type, dict[str, set[str]]] = {
    Sequence: {
        # the scheduler and its block manager: KV blocks, progress, preemption
        "block_table": {"block_manager.py"},
        "block_hashes": {"block_manager.py"},
        "num_hashed_blocks": {"block_manager.py"},
        "num_cached_tokens": {"block_manager.py"},
        "host_block_table": {"scheduler.py"},
        "num_preemptions": {"scheduler.py"},
        "num_computed_tokens": {
            "block_manager.py",
            "scheduler.py",
            "llm_engine.py",  # a step's tokens are computed once it ran
            "async_scheduling.py",  # ... or once it is launched, with --async-scheduling
            "pooling_step.py",
            "speculation.py",
            "spec_decode/draft.py",  # on its shadow copy
        },
        "status": {"scheduler.py", "output_processor.py", "llm_engine.py", "pooling_step.py"},
        "virtual_engine": {"llm_engine.py"},
        "num_output_placeholders": {"async_scheduling.py"},
        # made once, by the input processor that builds the request
        "generator": {"input_processor.py"},
        "grammar": {"input_processor.py"},
        "lora_id": {"input_processor.py"},
        "pooling": {"input_processor.py"},
        # what a step produced
        "token_ids": {"output_processor.py", "spec_decode/draft.py"},
        "finish_reason": {"output_processor.py", "llm_engine.py", "pooling_step.py"},
        "stop_reason": {"output_processor.py"},
        "prompt_logprobs": {"input_processor.py", "output_processor.py"},
        "clear_proposal": {"scheduler.py", "speculation.py"},
    },
    Proposal: {
        "token_ids": {"scheduler.py", "spec_decode/ngram.py", "spec_decode/draft.py"},
        "draft_probs": {"spec_decode/draft.py"},
        "bitmask": {"spec_decode/draft.py", "spec_decode/grammar.py"},
    },
    Request: {
        "finished": {"llm_engine.py"},
        "prompt_counted": {"output_processor.py"},
        "output_states": {"output_processor.py"},
        "record_scheduled": {"llm_engine.py", "pooling_step.py", "async_scheduling.py"},
        "record_tokens": {"output_processor.py", "pooling_step.py"},
        "update_counts": {"output_processor.py"},
    },
    OutputState: {
        name: {"output_processor.py"}
        for name in (
            "text",
            "logprobs",
            "cumulative_logprob",
            "num_tokens_sent",
            "num_chars_sent",
            "finish_sent",
        )
    },
}

MUTATING_CALLS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault"}


def writable_names(cls: type) -> set[str]:
    """Its fields and the methods it defines (properties aside)."""
    methods = {
        name
        for name, member in vars(cls).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    return {field.name for field in dataclasses.fields(cls)} | methods


def receiver_name(node: ast.expr) -> str | None:
    """`seq` for seq, item.seq and seqs[0]; None for anything else."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def writes(source: str) -> set[tuple[type, str]]:
    """(class, field or method) for every change the source makes through a named receiver."""
    changed: list[ast.expr] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            changed.extend(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            changed.append(node.target)
        elif isinstance(node, ast.Delete):
            changed.extend(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATING_CALLS:
                changed.append(node.func.value)
            else:
                changed.append(node.func)  # a method of the receiver's own class
    found = set()
    while changed:
        target = changed.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            changed.extend(target.elts)
            continue
        if isinstance(target, (ast.Starred, ast.Subscript)):
            target = target.value
        if not isinstance(target, ast.Attribute):
            continue
        cls = RECEIVERS.get(receiver_name(target.value) or "")
        if cls is not None and target.attr in writable_names(cls):
            found.add((cls, target.attr))
    return found


def engine_writes() -> dict[tuple[type, str], set[str]]:
    found: dict[tuple[type, str], set[str]] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for key in writes(path.read_text()):
            found.setdefault(key, set()).add(path.relative_to(ENGINE).as_posix())
    return found


def test_only_the_owners_write_each_field():
    unexpected = [
        f"{cls.__name__}.{name} written by {module}"
        for (cls, name), modules in sorted(engine_writes().items(), key=str)
        for module in sorted(modules - ALLOWED_WRITERS[cls].get(name, set()))
    ]
    assert unexpected == [], unexpected


def test_the_allowlist_names_real_fields_and_writers():
    """No entry outlives its write: a module that stops writing a field leaves the list."""
    found = engine_writes()
    for cls, allowed in ALLOWED_WRITERS.items():
        assert set(allowed) <= writable_names(cls), cls.__name__
        stale = {
            f"{cls.__name__}.{name}: {sorted(modules - found.get((cls, name), set()))}"
            for name, modules in allowed.items()
            if modules - found.get((cls, name), set())
        }
        assert stale == set(), stale


def test_the_scan_sees_every_kind_of_write():
    source = """
def f(seq, item, request, state, other):
    seq.block_table = []
    item.seq.num_computed_tokens += 4
    seqs[0].token_ids.append(5)
    del seq.proposal.token_ids[2:]
    state.text, state.num_chars_sent = "a", 1
    request.record_tokens(0.0)
    self.requests["r"].update_counts()
    seq.num_tokens  # a read
    other.status = 1  # not a receiver the test knows
    request.params.n = 2  # a field of something the request holds, not the request's
"""
    assert writes(source) == {
        (Sequence, "block_table"),
        (Sequence, "num_computed_tokens"),
        (Sequence, "token_ids"),
        (Proposal, "token_ids"),
        (OutputState, "text"),
        (OutputState, "num_chars_sent"),
        (Request, "record_tokens"),
        (Request, "update_counts"),
    }


def test_the_receiver_names_hold():
    """A parameter annotated with one of the classes goes by one of its names, so the scan sees
    what is written through it."""
    names = {cls.__name__: {n for n, c in RECEIVERS.items() if c is cls} for cls in ALLOWED_WRITERS}
    wrong = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and isinstance(node.annotation, ast.Name):
                expected = names.get(node.annotation.id)
                if expected is not None and node.arg not in expected:
                    wrong.append(f"{path.name}: {node.arg}: {node.annotation.id}")
    assert wrong == [], wrong


# Given a step's frozen inputs, never the live state (engine/step_input.py).
STEP_CONSUMERS = (
    "nanoserve.engine.model_runner",
    "nanoserve.engine.model_input",
    "nanoserve.engine.sampling_batch",
    "nanoserve.engine.spec_decode.verify",
)
# The modules that define or hand out the live per-request state.
LIVE_STATE = {
    "nanoserve.engine.sequence",
    "nanoserve.engine.scheduler",
    "nanoserve.engine.seq_inputs",
    "nanoserve.engine.request",
    "nanoserve.engine.output_state",
    "nanoserve.engine.output_processor",
    "nanoserve.engine.llm_engine",
}


def reachable(module: str) -> set[str]:
    """Every nanoserve module `module` imports, directly or through others."""
    known = set(module_names())
    seen, todo = set(), [module]
    while todo:
        for name in imported_modules(todo.pop(), known) - seen:
            seen.add(name)
            todo.append(name)
    return seen


@pytest.mark.parametrize("module", STEP_CONSUMERS)
def test_the_runner_and_the_sampling_see_no_live_sequence(module):
    """They can neither name a Sequence nor reach a module that does, so whatever they read of
    a sequence came in its SeqInput, and nothing they do changes one."""
    assert reachable(module) & LIVE_STATE == set()
    assert "Sequence" not in {
        node.id
        for node in ast.walk(ast.parse(Path(importlib_path(module)).read_text()))
        if isinstance(node, ast.Name)
    }


def importlib_path(module: str) -> str:
    return str(ENGINE.parent.parent.joinpath(*module.split(".")).with_suffix(".py"))


def test_the_import_scan_sees_a_path_to_the_live_state():
    """The check above fails when it should: the engine core reaches the sequences."""
    assert "nanoserve.engine.sequence" in reachable("nanoserve.engine.llm_engine")
    assert "nanoserve.engine.sequence" in reachable("nanoserve.engine.pipeline_driver")


def test_a_step_input_cannot_be_changed():
    sampling = SamplingInput(0, SamplingParams(), None, 0)
    item = SeqInput(0, (1, 2), 0, (3,), 0, False, True, sampling)
    for record, name, value in ((item, "start", 1), (sampling, "num_output_tokens", 1)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, name, value)
