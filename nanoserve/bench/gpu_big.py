"""Issue 29's targets on Llama-3.1-8B's shape, for scripts/gpu_check.sh: random weights drawn on
the GPU (the device machine downloads nothing) and written as a checkpoint of one format, then
batch-1 decode TPOT with CUDA graphs and the GPU memory the weights take:

    python3 -m nanoserve.bench.gpu_big bf16|fp8|q4_k_m --tokenizer DIR --work DIR [--smoke]

bf16: safetensors, as Meta's release (16 GB). fp8: quant_method "fp8" with 128 x 128 block
scales (weight_scale_inv, as Qwen3-FP8 and DeepSeek store them), the embedding and LM head in
bf16 (8.5 GB). q4_k_m: a GGUF mixed as llama.cpp's Q4_K_M mixes an 8B Llama (Q4_K, Q6_K for V and
the down projection in the layers llama.cpp's use_more_bits picks and for the output; 4.9 GB),
its blocks random bytes with scales that keep the activations in range, and the tokenizer's
vocabulary padded with reserved tokens to the shape's 128256. The GGUF needs the `gguf` package.

Writes WORK/big-llama-3.1-8b-<format>.json: tpot_ms (median of 3 x 128 tokens at batch 1),
weights_gpu_bytes (torch.cuda.memory_allocated across the model's build: what the weights hold
on the device), the engine's own count (weight_bytes) and the file's size. gpu_report judges the
targets. --smoke: a tiny shape on a CPU, to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from nanoserve.bench.throughput import greedy_timed

LLAMA_3_1_8B = {
    "hidden": 4096,
    "intermediate": 14336,
    "layers": 32,
    "heads": 32,
    "kv_heads": 8,
    "vocab": 128256,
    "rope_theta": 500000.0,
}
SMOKE_SHAPE = {
    "hidden": 256,
    "intermediate": 512,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 512,
    "rope_theta": 10000.0,
}
FORMATS = ("bf16", "fp8", "q4_k_m")
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
FP8_BLOCK = 128
# K-quant super-blocks: bytes per 256 values, and where the f16 scale d lies in a block.
K_BLOCK_BYTES = {"q4_k": 144, "q6_k": 210}


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """A layer's projections (Hugging Face names): [outputs, inputs]."""
    head_dim = shape["hidden"] // shape["heads"]
    hidden, inter = shape["hidden"], shape["intermediate"]
    return {
        "self_attn.q_proj": (shape["heads"] * head_dim, hidden),
        "self_attn.k_proj": (shape["kv_heads"] * head_dim, hidden),
        "self_attn.v_proj": (shape["kv_heads"] * head_dim, hidden),
        "self_attn.o_proj": (hidden, shape["heads"] * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def hf_config(shape: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["hidden"] // shape["heads"],
        "rms_norm_eps": 1e-5,
        "rope_theta": shape["rope_theta"],
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


class Draw:
    """Random tensors drawn on `device` from one seed, brought to the host for the file."""

    def __init__(self, device: str, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def normal(self, rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.generator, device=self.device) * std

    def bytes(self, *shape: int) -> torch.Tensor:
        return torch.randint(
            0, 256, shape, generator=self.generator, device=self.device, dtype=torch.uint8
        )


def write_bf16(draw: Draw, shape: dict, out_dir: Path) -> None:
    from safetensors.torch import save_file

    def weight(rows: int, cols: int) -> torch.Tensor:
        return draw.normal(rows, cols, cols**-0.5).to(torch.bfloat16).cpu()

    def ones() -> torch.Tensor:  # (safetensors refuses tensors that share memory)
        return torch.ones(shape["hidden"], dtype=torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": weight(shape["vocab"], shape["hidden"]),
        "lm_head.weight": weight(shape["vocab"], shape["hidden"]),
        "model.norm.weight": ones(),
    }
    for layer in range(shape["layers"]):
        prefix = f"model.layers.{layer}."
        for name, (rows, cols) in linear_shapes(shape).items():
            tensors[prefix + name + ".weight"] = weight(rows, cols)
        tensors[prefix + "input_layernorm.weight"] = ones()
        tensors[prefix + "post_attention_layernorm.weight"] = ones()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(shape), indent=2))


def write_fp8(draw: Draw, shape: dict, out_dir: Path) -> None:
    """E4M3 values of a normal(0, 64) draw, each 128 x 128 block's scale 1 / (64 sqrt(inputs))."""
    from safetensors.torch import save_file

    def bf16(rows: int, cols: int) -> torch.Tensor:
        return draw.normal(rows, cols, cols**-0.5).to(torch.bfloat16).cpu()

    def ones() -> torch.Tensor:  # (safetensors refuses tensors that share memory)
        return torch.ones(shape["hidden"], dtype=torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": bf16(shape["vocab"], shape["hidden"]),
        "lm_head.weight": bf16(shape["vocab"], shape["hidden"]),
        "model.norm.weight": ones(),
    }
    for layer in range(shape["layers"]):
        prefix = f"model.layers.{layer}."
        for name, (rows, cols) in linear_shapes(shape).items():
            values = draw.normal(rows, cols, 64.0).clamp(-448, 448).to(torch.float8_e4m3fn)
            blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            tensors[prefix + name + ".weight"] = values.cpu()
            tensors[prefix + name + ".weight_scale_inv"] = torch.full(
                blocks, 1 / (64 * cols**0.5), dtype=torch.float32
            )
        tensors[prefix + "input_layernorm.weight"] = ones()
        tensors[prefix + "post_attention_layernorm.weight"] = ones()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(shape)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def random_k_blocks(draw: Draw, rows: int, cols: int, qtype: str):
    """[rows, cols / 256 * bytes] uint8 (numpy) of random K-quant super-blocks whose weights have
    about the spread of normal(0, 1 / sqrt(cols)): random codes and 6-bit / int8 scales, the
    f16 d (and Q4_K's dmin, which centres the codes) chosen for that spread."""
    blocks = draw.bytes(rows * cols // 256, K_BLOCK_BYTES[qtype])
    spread = cols**-0.5
    if qtype == "q4_k":  # w = d * sc * q - dmin * m; sc, m in 0..63, q in 0..15: std(sc q) ~ 218
        d = torch.full((blocks.shape[0],), spread / 218, dtype=torch.float16, device=draw.device)
        blocks[:, 0:2] = d.view(torch.uint8).view(-1, 2)
        blocks[:, 2:4] = (d * 7.5).view(torch.uint8).view(-1, 2)
    else:  # q6_k: w = d * sc * (q - 32); sc int8, q in 0..63: std ~ 1365; d the last 2 bytes
        d = torch.full((blocks.shape[0],), spread / 1365, dtype=torch.float16, device=draw.device)
        blocks[:, 208:210] = d.view(torch.uint8).view(-1, 2)
    return blocks.cpu().numpy().reshape(rows, -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's llama-quant.cpp: the layers whose V and down projections Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tokenizer_size(tokenizer_dir: Path) -> int:
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = set(tokenizer["model"]["vocab"].values())
    return len(ids | {added["id"] for added in tokenizer["added_tokens"]})


def add_gguf_tokenizer(writer, tokenizer_dir: Path, vocab: int) -> None:
    """tokenizer_dir's BPE vocabulary (a gpt2-style tokenizer.json) in llama.cpp's metadata,
    padded with reserved control tokens to `vocab` entries (the embedding's rows)."""
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config_file = tokenizer_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text()) if config_file.exists() else {}
    ids = dict(tokenizer["model"]["vocab"])
    ids |= {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    tokens = sorted(ids, key=ids.get)
    if len(tokens) > vocab:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the shape's {vocab}")
    specials = {added["content"] for added in tokenizer["added_tokens"]}
    types = [3 if token in specials else 1 for token in tokens]
    tokens += [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
    types += [3] * (vocab - len(types))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        token = tokenizer_config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            add(ids[token])
    writer.add_add_bos_token(False)


def write_q4_k_m(draw: Draw, shape: dict, out_dir: Path, tokenizer_dir: Path) -> Path:
    import gguf
    import numpy as np

    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape["rope_theta"])
    add_gguf_tokenizer(writer, tokenizer_dir, shape["vocab"])
    types = gguf.GGMLQuantizationType
    ones = np.ones(shape["hidden"], dtype=np.float32)

    def add(name: str, rows: int, cols: int, qtype: str) -> None:
        data = random_k_blocks(draw, rows, cols, qtype)
        writer.add_tensor(name, data, raw_dtype=getattr(types, qtype.upper()))

    add("token_embd.weight", shape["vocab"], shape["hidden"], "q4_k")
    add("output.weight", shape["vocab"], shape["hidden"], "q6_k")
    writer.add_tensor("output_norm.weight", ones)
    for layer in range(shape["layers"]):
        more = use_more_bits(layer, shape["layers"])
        for name, (rows, cols) in linear_shapes(shape).items():
            bigger = more and name in ("self_attn.v_proj", "mlp.down_proj")
            add(f"blk.{layer}.{GGUF_NAMES[name]}.weight", rows, cols, "q6_k" if bigger else "q4_k")
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_checkpoint(fmt: str, shape: dict, out_dir: Path, tokenizer_dir: Path, device: str):
    """The model path the engine loads (a directory, or the GGUF file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    draw = Draw(device)
    if fmt == "q4_k_m":
        path = write_q4_k_m(draw, shape, out_dir, tokenizer_dir)
    else:
        (write_bf16 if fmt == "bf16" else write_fp8)(draw, shape, out_dir)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, out_dir / name)
        path = out_dir
    del draw
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


@contextmanager
def build_memory(device: str):
    """Within: the runner's model build records torch.cuda.memory_allocated across it (the
    bytes the weights, and whatever the load leaves on the device, hold) in the dict yielded."""
    import nanoserve.engine.model_runner as model_runner

    record = {}
    real = model_runner.build_model

    def build(*args, **kwargs):
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        model = real(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
            record["weights_gpu_bytes"] = torch.cuda.memory_allocated() - before
        return model

    model_runner.build_model = build
    try:
        yield record
    finally:
        model_runner.build_model = real


def measure(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    shape = dict(SMOKE_SHAPE if args.smoke else LLAMA_3_1_8B)
    if args.smoke:  # room for the tokenizer's vocabulary, whichever it is
        shape["vocab"] = max(shape["vocab"], -(-tokenizer_size(Path(args.tokenizer)) // 64) * 64)
    work = Path(args.work) / f"big-{args.format}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        return measure_in(args, shape, work, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # 16 GB for bf16


def measure_in(args, shape: dict, work: Path, device: str) -> dict:
    from nanoserve import LLM

    started = time.perf_counter()
    path = write_checkpoint(args.format, shape, work, Path(args.tokenizer), device)
    file_bytes = sum(f.stat().st_size for f in work.rglob("*") if f.is_file())
    result = {"shape": shape, "write_s": time.perf_counter() - started, "file_bytes": file_bytes}
    started = time.perf_counter()
    with build_memory(device) as record:
        llm = LLM(
            model=str(path),
            dtype="bfloat16",
            device=device,
            seed=0,
            max_model_len=1024,
            max_num_seqs=4,
            num_kv_blocks=512,
        )
    result["load_s"] = time.perf_counter() - started
    runner = llm.llm_engine.runner
    result |= record
    result["weight_bytes"] = runner.weight_bytes
    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(4)]
    output_len = 8 if args.smoke else 128
    greedy_timed(llm, prompts[:1], 8)  # warm-up (compiles what the graphs did not)
    tpots = []
    for prompt in prompts[1:]:
        outputs, _ = greedy_timed(llm, [prompt], output_len)
        metrics = outputs[0].metrics
        tpots.append((metrics.last_token_time - metrics.first_token_time) / (output_len - 1))
    result["tpot_ms"] = 1e3 * statistics.median(tpots)
    graphs = runner.decode_graphs
    result["graph_steps"] = graphs.num_steps if graphs is not None else 0
    result["ok"] = args.smoke or result["graph_steps"] > 0
    if not result["ok"]:
        result["error"] = "no decode step went through the CUDA graphs"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    parser.add_argument("--work", required=True, help="directory for big-<name>.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on a CPU")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("nanoserve.bench.gpu_big: no CUDA device (--smoke runs it on a CPU)", file=sys.stderr)
        return 2
    name = f"{'smoke' if args.smoke else 'llama-3.1-8b'}-{args.format}"
    started = time.perf_counter()
    try:
        result = measure(args)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr)
    result |= {
        "stage": "big",
        "name": name,
        "format": args.format,
        "seconds": time.perf_counter() - started,
    }
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / f"big-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"big {name}: {'ok' if result['ok'] else 'FAILED'} {json.dumps(result)[:1500]}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
