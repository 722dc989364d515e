"""A mixture-of-experts GGUF file served as it is, nanoserve against llama.cpp on the same file.

Writes a qwen3moe GGUF of Qwen3-30B-A3B's shape (hidden 2048, 32 query heads and 4 KV heads of
128, 128 experts of intermediate 768, top-8, Q/K norms) cut to --layers decoder layers, with the
default model's tokenizer (SmolLM2's 49,152 tokens: a smaller vocabulary than Qwen3's 151,936) and
random blocks in llama.cpp's Q4_K_M mix (Q4_K, Q6_K for attn_v and ffn_down_exps in the layers
llama.cpp's use_more_bits picks, the router and norms F32) or all Q8_0. Then runs batch-1 decode
(16-token prompt, 256 greedy tokens, median of 3 after a warm-up, the shape of
../shared/bench/batch1.sh) with llama.cpp (llama-cpp-python, ../shared/bench/setup-llamacpp.sh)
and with nanoserve, each in a process of its own, and nanoserve's offline throughput (no peer:
llama-cpp-python has no batched generate). Not a test. `--arch gpt-oss`: a gpt-oss file of
gpt-oss-20b's shape (hidden 2880, 64 query and 8 KV heads of 64, 32 experts of 2880, top-4, YaRN,
a sliding window of 128 on every other layer, attention sinks, biases) as ggml-org's: experts in
MXFP4 (random codes, exponents giving values about 1 / sqrt(k)), the other matrices Q8_0.

    .venv/bin/python benchmarks/moe/gguf_moe.py --layers 4 --out-dir /tmp/qwen3moe-gguf
    .venv/bin/python benchmarks/moe/gguf_moe.py --arch gpt-oss --layers 4 --out-dir /tmp/gpt-oss-gguf
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout

QWEN3_30B_A3B = dict(
    hidden=2048,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    top_k=8,
    expert_inter=768,
    dense_inter=6144,
)
GPT_OSS_20B = dict(
    hidden=2880,
    heads=64,
    kv_heads=8,
    head_dim=64,
    experts=32,
    top_k=4,
    expert_inter=2880,
    sliding_window=128,
)
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", Path.home() / ".cache/llamacpp/venv"))
BATCH1_LLAMACPP = ROOT.parent / "shared/bench/batch1_llamacpp.py"

NANOSERVE_BATCH1 = """
import statistics, sys, time
from nanoserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=2048)
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
def run():
    t = time.perf_counter()
    o = llm.generate([{"prompt_token_ids": list(range(200, 216))}], sp, use_tqdm=False)
    return (time.perf_counter() - t) / len(o[0].outputs[0].token_ids)
run()
print(f"nanoserve {sys.argv[1].rsplit('/', 1)[-1]}: {1000 * statistics.median(run() for _ in range(3)):.2f} ms/token")
"""

NANOSERVE_OFFLINE = """
import sys, time
import numpy as np
from nanoserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=2048)
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(100, 40000, 128).tolist()} for _ in range(32)]
sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
t = time.perf_counter()
outputs = llm.generate(prompts, sp, use_tqdm=False)
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
rate = tokens / (time.perf_counter() - t)
print(f"nanoserve {sys.argv[1].rsplit('/', 1)[-1]} offline 32 x (128, 64): {rate:.1f} output tokens/s")
"""


def _random_blocks(rows: int, k: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of values about N(0, 1 / sqrt(k)) in size."""
    from tests.gguf_models import _random_k_blocks

    if qtype != "q8_0":
        return _random_k_blocks(rows, k, qtype, rng)
    raw = rng.integers(0, 256, size=(rows, k // 32, 34), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=(rows, k // 32, 1)) * 2.0 / np.sqrt(k) / 64
    raw[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(rows, k // 32, 2)
    return raw.reshape(rows, -1)


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_mxfp4(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random MXFP4 blocks (ggml's: an E8M0 byte, 16 bytes of codes) of values about 1 / sqrt(k):
    2^(e - 128) x 2 x E2M1 with E2M1 up to 6."""
    raw = rng.integers(0, 256, size=(rows, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = (
        128 - 4 - int(np.ceil(np.log2(np.sqrt(k)))) + rng.integers(0, 2, size=(rows, k // 32))
    )
    return raw.reshape(rows, -1)


def write_gguf(path: Path, layers: int, mix: str, seed: int = 0, arch: str = "qwen3moe") -> Path:
    import gguf

    from nanoserve.models.gguf.importer import ensure_default_gguf
    from nanoserve.models.gguf.reader import read_metadata

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = read_metadata(gguf.GGUFReader(ensure_default_gguf()))
    s = GPT_OSS_20B if arch == "gpt-oss" else QWEN3_30B_A3B
    hidden = s["hidden"]
    vocab = len(meta["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path) + ".partial", arch)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(s.get("dense_inter", s["expert_inter"]))
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(150000.0 if arch == "gpt-oss" else 1000000.0)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "gpt-oss" else 1e-6)
    writer.add_expert_count(s["experts"])
    writer.add_expert_used_count(s["top_k"])
    writer.add_expert_feed_forward_length(s["expert_inter"])
    if arch == "gpt-oss":  # as llama.cpp's converter writes gpt-oss-20b's (context cut to 4096)
        writer.add_sliding_window(s["sliding_window"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("padding", writer.add_pad_token_id),
    ):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            add(meta[f"tokenizer.ggml.{key}_token_id"])
    writer.add_chat_template(meta["tokenizer.chat_template"])
    rng = np.random.default_rng(seed)

    def add(
        name: str, rows: int, k: int, qtype: str, experts: int = 0, shape: tuple | None = None
    ) -> None:
        if qtype == "f32":  # norms (and, for gpt-oss, biases and sinks: small) or a matrix
            one = name.endswith("norm.weight")
            values = (
                (np.ones(rows, np.float32) if one else rng.normal(0, 0.02, rows).astype(np.float32))
                if k == 0
                else rng.normal(0, k**-0.5, (rows, k)).astype(np.float32)
            )
            writer.add_tensor(name, values.reshape(shape) if shape else values)
            return
        blocks = (
            _random_mxfp4 if qtype == "mxfp4" else lambda r, c, g: _random_blocks(r, c, qtype, g)
        )
        if experts:
            data = np.stack([blocks(rows, k, rng) for _ in range(experts)])
        else:
            data = blocks(rows, k, rng)
        writer.add_tensor(name, data, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype.upper()))

    if arch == "gpt-oss":
        _add_gpt_oss_tensors(add, layers, vocab, s, mix)
    else:
        _add_qwen3moe_tensors(add, layers, vocab, s, mix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".partial", path)
    return path


def _add_gpt_oss_tensors(add, layers: int, vocab: int, s: dict, mix: str) -> None:
    """ggml-org's gpt-oss-20b file's types: the experts MXFP4, the other matrices Q8_0 (`mix`
    "mxfp4"); biases, sinks, router and norms F32."""
    hidden, q_size, kv_size = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    add("token_embd.weight", vocab, hidden, "q8_0")
    add("output_norm.weight", hidden, 0, "f32")
    add("output.weight", vocab, hidden, "q8_0")
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden, 0, "f32")
        add(f"blk.{i}.post_attention_norm.weight", hidden, 0, "f32")
        add(f"blk.{i}.attn_sinks.weight", s["heads"], 0, "f32")
        for name, rows, k in (
            ("attn_q", q_size, hidden),
            ("attn_k", kv_size, hidden),
            ("attn_v", kv_size, hidden),
            ("attn_output", hidden, q_size),
        ):
            add(f"blk.{i}.{name}.weight", rows, k, "q8_0")
            add(f"blk.{i}.{name}.bias", rows, 0, "f32")
        add(f"blk.{i}.ffn_gate_inp.weight", s["experts"], hidden, "f32")
        add(f"blk.{i}.ffn_gate_inp.bias", s["experts"], 0, "f32")
        for name, rows, k in (
            ("ffn_gate_exps", s["expert_inter"], hidden),
            ("ffn_up_exps", s["expert_inter"], hidden),
            ("ffn_down_exps", hidden, s["expert_inter"]),
        ):
            add(f"blk.{i}.{name}.weight", rows, k, mix, s["experts"])
            add(f"blk.{i}.{name}.bias", s["experts"] * rows, 0, "f32", shape=(s["experts"], rows))


def _add_qwen3moe_tensors(add, layers: int, vocab: int, s: dict, mix: str) -> None:
    hidden, q_size, kv_size = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    base = "q8_0" if mix == "q8_0" else "q4_k"
    add("token_embd.weight", vocab, hidden, base)
    add("output_norm.weight", hidden, 0, "f32")
    add("output.weight", vocab, hidden, "q8_0" if mix == "q8_0" else "q6_k")
    for i in range(layers):
        more = mix != "q8_0" and _use_more_bits(i, layers)
        add(f"blk.{i}.attn_norm.weight", hidden, 0, "f32")
        add(f"blk.{i}.ffn_norm.weight", hidden, 0, "f32")
        add(f"blk.{i}.attn_q_norm.weight", s["head_dim"], 0, "f32")
        add(f"blk.{i}.attn_k_norm.weight", s["head_dim"], 0, "f32")
        add(f"blk.{i}.attn_q.weight", q_size, hidden, base)
        add(f"blk.{i}.attn_k.weight", kv_size, hidden, base)
        add(f"blk.{i}.attn_v.weight", kv_size, hidden, "q6_k" if more else base)
        add(f"blk.{i}.attn_output.weight", hidden, q_size, base)
        add(f"blk.{i}.ffn_gate_inp.weight", s["experts"], hidden, "f32")
        add(f"blk.{i}.ffn_gate_exps.weight", s["expert_inter"], hidden, base, s["experts"])
        add(f"blk.{i}.ffn_up_exps.weight", s["expert_inter"], hidden, base, s["experts"])
        add(
            f"blk.{i}.ffn_down_exps.weight",
            hidden,
            s["expert_inter"],
            "q6_k" if more else base,
            s["experts"],
        )


def run(command: list[str], cwd: Path = ROOT) -> str:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        return f"{command[-1]} failed: {result.stderr.strip().splitlines()[-1:]}"
    return lines[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/nanoserve-bench-qwen3moe-gguf"))
    parser.add_argument(
        "--mixes", default=None, help="qwen3moe: q4_k_m,q8_0 (default); gpt-oss: mxfp4"
    )
    parser.add_argument(
        "--arch",
        default="qwen3moe",
        choices=["qwen3moe", "gpt-oss"],
        help="gpt-oss: gpt-oss-20b's shape (hidden 2880, 64 / 8 heads of 64, 32 experts of "
        "2880, top-4, YaRN, sliding window 128), experts MXFP4, the rest Q8_0",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another nanoserve checkout (e.g. `git worktree add /tmp/base COMMIT`) run beside "
        "this one each round, by the same Python (its nanoserve imported from its folder)",
    )
    args = parser.parse_args()
    subprocess.run(
        [
            "bash",
            "-c",
            "lscpu | sed -n 's/^Model name: */cpu: /p'; git log -1 --format='nanoserve %h'",
        ],
        cwd=ROOT,
    )
    if args.baseline:
        subprocess.run(["git", "log", "-1", "--format=baseline nanoserve %h"], cwd=args.baseline)
    print(f"llama.cpp: {LLAMACPP_VENV}", flush=True)
    mixes = args.mixes or ("mxfp4" if args.arch == "gpt-oss" else "q4_k_m,q8_0")
    files = [
        write_gguf(
            args.out_dir / f"{args.arch}-{args.layers}l-{mix}.gguf",
            args.layers,
            mix,
            arch=args.arch,
        )
        for mix in mixes.split(",")
    ]
    python = str(ROOT / ".venv/bin/python")
    for round_ in range(1, args.rounds + 1):
        for path in files:
            print(
                f"round {round_}: {run([str(LLAMACPP_VENV / 'bin/python'), str(BATCH1_LLAMACPP), str(path)])}",
                flush=True,
            )
            for checkout in [ROOT] + ([args.baseline.resolve()] if args.baseline else []):
                label = "" if checkout == ROOT else f" (baseline {checkout})"
                for script in (NANOSERVE_BATCH1, NANOSERVE_OFFLINE):
                    print(
                        f"round {round_}{label}: {run([python, '-c', script, str(path)], checkout)}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
