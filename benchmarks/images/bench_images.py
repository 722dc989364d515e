"""One image + 64 output tokens (issue 56): nanoserve serving a GGUF text model with its mmproj
(`--model text.gguf --mmproj mmproj.gguf`) against transformers' LlavaForConditionalGeneration on
the Hugging Face checkpoint the two files come from, and against llama.cpp's `llama-server
--mmproj` on the same two files. Each engine runs in a process of its own, one after the other,
with the same thread count; each gets the same request: one chat turn with one image and a short
question, greedy, 64 output tokens (end of sequence ignored).

Not a test. Run it from the project root on an idle machine (`make install`; llama-server from
../shared/bench/setup-llamacpp-tools.sh):

    .venv/bin/python benchmarks/images/bench_images.py                 # the real shape
    .venv/bin/python benchmarks/images/bench_images.py --shape tiny    # a minute: checks it runs

The checkpoint (written once into --out-dir, random weights: the speed depends on the shape, not
on the values): LLaVA-1.5's vision side as llava-1.5-7b-hf has it, CLIP ViT-L/14 at 336 pixels
(24 layers of hidden 1024, 576 image tokens, features from layer -2) and the two-layer projector,
with a language model of Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 KV heads,
vocabulary 128,256) instead of Vicuna-7B's, so that the three engines fit side by side. Its
tokenizer is a small byte-level BPE trained here, its vocabulary padded to the model's with
unused tokens, and "<image>" last (as llava-hf's). The GGUF files are written as llama.cpp's
converters write them (tests/multimodal/llava_gguf.py): the text model's matrices --text-type
(BF16), the mmproj F16 (the LLaVA converter's default); the Hugging Face folder is bf16.
nanoserve runs in --dtype (bfloat16), transformers in --hf-dtype (float32, its fastest on a CPU
without native bf16 arithmetic), llama-server in the files' types.

Measured per request, from the client: time to first token (the image's decoding, preprocessing
and encoding included: a new image each request, so no engine reuses an encoded one) and decode
tokens/s after the first token ((tokens - 1) / (last token's time - first token's time)). The
servers stream (SSE); transformers' generate reports each token to a streamer. Each figure is the
median of --repeats requests after one warm-up request; the ratios are nanoserve's against each.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout

LLAMA_SERVER = Path.home() / ".cache/llamacpp/tools/build/bin/llama-server"
QUESTION = "Describe the picture in detail."
# LLaVA-1.5's conversation format as a string template: both servers render an image part where
# its content puts it ("<image>" for nanoserve, llama.cpp's "<__media__>" marker for llama-server).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'USER: ' + message['content'] + ' ' }}{% else %}"
    "{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
HF_PROMPT = f"USER: <image>\n{QUESTION} ASSISTANT:"  # what the template renders, for transformers
SHAPES = {
    "llava-1.5-clip-l-336+llama-3.2-1b": dict(
        vision=dict(
            image_size=336,
            patch_size=14,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            projection_dim=768,
        ),
        text=dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
        ),
        image=(640, 480),
    ),
    "tiny": dict(
        vision=dict(
            image_size=56,
            patch_size=14,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=32,
        ),
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=2048,
            rope_theta=10000.0,
        ),
        image=(80, 60),
    ),
}
TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog " * 4,
    "describe the picture in detail what is in the image a photo of a cat on a sofa",
    "USER: ASSISTANT: images tokens models servers requests answers questions",
]


# ---------------------------------------------------------------- the checkpoint and its files


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE, its vocabulary padded with "[PAD i]" tokens to vocab_size - 1 entries,
    then "<image>" (special) as the last id; LLaVA-1.5's string template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(1000, vocab_size - 1),
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    raw = json.loads(tokenizer.to_str())
    vocab = raw["model"]["vocab"]
    for index in range(len(vocab), vocab_size - 1):
        vocab[f"[PAD{index}]"] = index
    raw["added_tokens"].append(
        {
            "id": vocab_size - 1,
            "content": "<image>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (out_dir / "tokenizer.json").write_text(json.dumps(raw))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "extra_special_tokens": {"image_token": "<image>"},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def write_checkpoint(hf_dir: Path, shape: dict) -> None:
    import torch
    import transformers as hf

    hf_dir.mkdir(parents=True, exist_ok=True)
    text = shape["text"]
    write_tokenizer(hf_dir, text["vocab_size"])
    vision = shape["vision"]
    image_tokens = (vision["image_size"] // vision["patch_size"]) ** 2
    config = hf.LlavaConfig(
        vision_config=hf.CLIPVisionConfig(**vision),
        text_config=hf.LlamaConfig(
            **text, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2
        ),
        image_token_index=text["vocab_size"] - 1,
        image_seq_length=image_tokens,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of a float32 build
    try:
        model = hf.LlavaForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(hf_dir, safe_serialization=True)
    size = vision["image_size"]
    hf.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(hf_dir)


def prepare(out_dir: Path, shape_name: str, text_type: str) -> tuple[Path, Path, Path]:
    """The Hugging Face folder, the text GGUF and the mmproj GGUF (written once)."""
    from tests.multimodal.llava_gguf import write_mmproj_gguf, write_text_gguf

    hf_dir = out_dir / "hf"
    text_gguf, mmproj = out_dir / f"text-{text_type}.gguf", out_dir / "mmproj-F16.gguf"
    if not (hf_dir / "model.safetensors").exists():
        print(f"writing the {shape_name} checkpoint into {hf_dir}", flush=True)
        shutil.rmtree(hf_dir, ignore_errors=True)
        write_checkpoint(hf_dir, SHAPES[shape_name])
    if not text_gguf.exists():
        print(f"writing {text_gguf}", flush=True)
        write_text_gguf(hf_dir, text_gguf.with_suffix(".partial"), matrix_type=text_type)
        text_gguf.with_suffix(".partial").rename(text_gguf)
    if not mmproj.exists():
        print(f"writing {mmproj}", flush=True)
        write_mmproj_gguf(hf_dir, mmproj.with_suffix(".partial"))
        mmproj.with_suffix(".partial").rename(mmproj)
    return hf_dir, text_gguf, mmproj


def images(count: int, size: tuple[int, int]) -> list[bytes]:
    """`count` different PNG images (seeded noise over a gradient)."""
    import numpy as np
    from PIL import Image

    width, height = size
    out = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        gradient = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
        pixels = np.clip(gradient * 0.5 + rng.integers(0, 128, (height, width, 3)), 0, 255)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8), "RGB").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


# ---------------------------------------------------------------- the servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def chat_request(url: str, image: bytes, max_tokens: int) -> dict:
    """One streamed chat completion: the client-side time to the first token, each later
    token's time, the server's usage (and llama-server's own timings)."""
    data = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {
        "model": "bench",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    token_times: list[float] = []
    usage, timings = None, None
    try:
        response = urllib.request.urlopen(request, timeout=3600)
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"HTTP {error.code}: {error.read()[:500]!r}") from None
    with response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    token_times.append(time.perf_counter() - start)
    if usage is None or not token_times:
        raise RuntimeError(f"no tokens or usage in the stream (usage {usage})")
    return {
        "ttft_s": token_times[0],
        "last_s": token_times[-1],
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "server_timings": timings,
    }


def run_server(command: list[str], env: dict, pictures: list[bytes], max_tokens: int) -> list:
    port = int(command[command.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-images-{port}.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, process)
        return [chat_request(url, picture, max_tokens) for picture in pictures]
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


# ---------------------------------------------------------------- transformers, in its own process


def transformers_worker(args: argparse.Namespace) -> None:
    """Prints one JSON line: each request's times, as chat_request measures them."""
    import torch
    import transformers as hf
    from PIL import Image

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = hf.LlavaForConditionalGeneration.from_pretrained(args.hf_dir, dtype=dtype).eval()
    processor = hf.LlavaProcessor(
        image_processor=getattr(hf, "CLIPImageProcessorPil", hf.CLIPImageProcessor).from_pretrained(
            args.hf_dir
        ),
        tokenizer=hf.AutoTokenizer.from_pretrained(args.hf_dir),
        patch_size=model.config.vision_config.patch_size,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )

    class Clock:
        """generate's streamer: put() is called with the prompt, then with each new token."""

        def __init__(self, start: float):
            self.start, self.times, self.prompt_seen = start, [], False

        def put(self, value) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter() - self.start)

        def end(self) -> None:
            pass

    results = []
    for picture in images(args.repeats + 1, tuple(args.image_size)):
        start = time.perf_counter()
        image = Image.open(io.BytesIO(picture)).convert("RGB")
        inputs = processor(text=HF_PROMPT, images=[image], return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        clock = Clock(start)
        with torch.no_grad():
            model.generate(
                **inputs,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=False,
                streamer=clock,
            )
        results.append(
            {
                "ttft_s": clock.times[0],
                "last_s": clock.times[-1],
                "completion_tokens": len(clock.times),
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "server_timings": None,
            }
        )
    print("RESULT " + json.dumps(results), flush=True)


# ---------------------------------------------------------------- the comparison


def summary(results: list[dict]) -> dict:
    timed = results[1:]  # the first request warms the engine up
    rates = [(r["completion_tokens"] - 1) / (r["last_s"] - r["ttft_s"]) for r in timed]
    return {
        "ttft_ms": statistics.median(r["ttft_s"] for r in timed) * 1000,
        "decode_tok_s": statistics.median(rates),
        "prompt_tokens": timed[0]["prompt_tokens"],
        "completion_tokens": timed[0]["completion_tokens"],
        "requests": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default=next(iter(SHAPES)))
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="nanoserve's"
    )
    parser.add_argument(
        "--hf-dtype",
        default="float32",
        choices=("bfloat16", "float32"),
        help="transformers' (float32: its fastest on a CPU without native bf16)",
    )
    parser.add_argument("--text-type", default="BF16", choices=("BF16", "F16", "Q8_0", "Q4_0"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--engines", nargs="+", default=["nanoserve", "transformers", "llama-server"]
    )
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--worker", choices=("transformers",), help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--image-size", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "transformers":
        transformers_worker(args)
        return
    out_dir = args.out_dir or Path.home() / ".cache/nanoserve-bench/images" / args.shape
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_dir, text_gguf, mmproj = prepare(out_dir, args.shape, args.text_type)
    image_size = SHAPES[args.shape]["image"]
    pictures = images(args.repeats + 1, image_size)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    figures = {}
    for engine in args.engines:
        print(f"running {engine} ({args.threads} threads)", flush=True)
        if engine == "nanoserve":
            command = [sys.executable, "-m", "nanoserve", "serve", "--model", str(text_gguf)]
            command += ["--mmproj", str(mmproj), "--dtype", args.dtype, "--max-model-len", "4096"]
            command += ["--served-model-name", "bench", "--port", str(free_port())]
            results = run_server(command, env, pictures, args.max_tokens)
        elif engine == "llama-server":
            if not args.llama_server.exists():
                raise SystemExit(f"{args.llama_server}: not built (setup-llamacpp-tools.sh)")
            command = [str(args.llama_server), "-m", str(text_gguf), "--mmproj", str(mmproj)]
            command += ["-t", str(args.threads), "-tb", str(args.threads), "-c", "4096", "-np", "1"]
            command += ["-a", "bench", "--port", str(free_port())]
            results = run_server(command, env, pictures, args.max_tokens)
        elif engine == "transformers":
            command = [
                sys.executable,
                __file__,
                "--worker",
                "transformers",
                "--hf-dir",
                str(hf_dir),
            ]
            command += ["--threads", str(args.threads), "--dtype", args.hf_dtype]
            command += ["--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens)]
            command += ["--image-size", *map(str, image_size)]
            output = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            line = next(x for x in output.stdout.splitlines() if x.startswith("RESULT "))
            results = json.loads(line.removeprefix("RESULT "))
        else:
            raise SystemExit(f"unknown engine {engine!r}")
        figures[engine] = summary(results)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    print(
        f"\n{args.shape}, {args.threads} threads, {cpu}; GGUF text {args.text_type}, mmproj F16; "
        f"nanoserve {args.dtype}, transformers {args.hf_dtype}"
    )
    print(f"{'engine':<14}{'prompt tok':>11}{'out tok':>9}{'TTFT ms':>10}{'decode tok/s':>14}")
    for engine, figure in figures.items():
        print(
            f"{engine:<14}{figure['prompt_tokens']:>11}{figure['completion_tokens']:>9}"
            f"{figure['ttft_ms']:>10.1f}{figure['decode_tok_s']:>14.2f}"
        )
    ours = figures.get("nanoserve")
    for engine, figure in figures.items():
        if ours is None or engine == "nanoserve":
            continue
        print(
            f"nanoserve vs {engine} (above 1: nanoserve ahead): time to first token "
            f"{figure['ttft_ms'] / ours['ttft_ms']:.2f}x, "
            f"decode tokens/s {ours['decode_tok_s'] / figure['decode_tok_s']:.2f}x"
        )
    if args.json is not None:
        setup = {"shape": args.shape, "cpu": cpu, "threads": args.threads, "dtype": args.dtype}
        setup |= {"hf_dtype": args.hf_dtype, "text_type": args.text_type}
        args.json.write_text(json.dumps({**setup, **figures}, indent=1))


if __name__ == "__main__":
    main()
