"""An 8B-shaped Q4_K_M GGUF of random blocks, run packed: its resident weight bytes against the
file's tensor bytes, and whether it fits in 8 GiB.

    python bench/bench_gguf_8b_memory.py [--shape 8b|1b] [--threads 2] [--new-tokens 4]

The file (written once to ~/.cache/pagedgen/bench, never committed): Llama-3-8B's layers (32 x
4096, FFN 14,336, GQA 32/8, vocabulary 128,256; `--shape 1b`: Llama-3.2-1B's, 16 x 2048, FFN
8,192, tied LM head, which bench_gguf_decode.py runs as `--models llama-1b-random`), Q4_K everywhere but where llama.cpp's Q4_K_M gives more bits — Q6_K
for the output matrix and for attn_v / ffn_down of the first and last eighth of the layers and
every third layer between — with random blocks of sane scales (tests/gguf_blocks.py) and a small
BPE tokenizer embedded, padded to the vocabulary (only the ids matter here). The run happens in a fresh process:
PSS before loading, after loading, and after a generate over a prompt and a few new tokens
(which touches every weight); resident weights = PSS after the generate minus PSS before the
load, less the KV blocks that generate wrote (the pool is lazily zeroed: untouched pages are not
resident); the embedding table is looked up by row, so most of it stays unread.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
BENCH_CACHE = Path.home() / ".cache" / "pagedgen" / "bench"
CHILD = "--child"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    tied: bool = False  # Llama-3.2-1B ties the LM head to the embedding

    @property
    def path(self) -> Path:
        return BENCH_CACHE / f"llama-{self.name}-q4_k_m-random.gguf"

    @property
    def name(self) -> str:
        return next(name for name, shape in SHAPES.items() if shape == self)


SHAPES = {"8b": Shape(32, 4096, 14336, 32, 8), "1b": Shape(16, 2048, 8192, 32, 8, tied=True)}
EMBEDDING_BLOCK_BYTES = 144  # the embedding table is Q4_K: 144 bytes per 256 values


def random_gguf(name: str) -> Path:
    """The random Q4_K_M file of that shape, written on first use."""
    shape = SHAPES[name]
    if not shape.path.exists():
        shape.path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        tensor_bytes = write_file(shape)
        print(f"wrote {shape.path} ({shape.path.stat().st_size / 1e9:.2f} GB, tensors "
              f"{tensor_bytes / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s", flush=True)
    return shape.path


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    eighth = layers // 8
    return layer < eighth or layer >= layers - eighth or (layer - eighth) % 3 == 2


def add_header(writer, shape: Shape) -> None:
    """The shape's hyperparameters and the padded tokenizer (GGUF key-value data)."""
    if str(ROOT.parent / "tests") not in sys.path:  # tiny_models, gguf_blocks
        sys.path[:0] = [str(ROOT.parent / "tests")]
    for key, value in (("block_count", shape.layers), ("context_length", 8192),
                       ("embedding_length", shape.hidden), ("feed_forward_length", shape.ffn),
                       ("attention.head_count", shape.heads),
                       ("attention.head_count_kv", shape.kv_heads)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    _embed_padded_tokenizer(writer, shape.vocab)


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in file order; kind "norm", or the Q4_K_M type
    name ("Q4_K", "Q6_K") a matrix gets from llama.cpp's quantizer."""
    head_dim = shape.hidden // shape.heads
    plan = [("token_embd.weight", (shape.vocab, shape.hidden), "Q4_K")]
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        extra = "Q6_K" if more_bits(layer, shape.layers) else "Q4_K"
        plan += [(prefix + "attn_norm.weight", (shape.hidden,), "norm"),
                 (prefix + "ffn_norm.weight", (shape.hidden,), "norm"),
                 (prefix + "attn_q.weight", (shape.heads * head_dim, shape.hidden), "Q4_K"),
                 (prefix + "attn_k.weight", (shape.kv_heads * head_dim, shape.hidden), "Q4_K"),
                 (prefix + "attn_v.weight", (shape.kv_heads * head_dim, shape.hidden), extra),
                 (prefix + "attn_output.weight", (shape.hidden, shape.heads * head_dim), "Q4_K"),
                 (prefix + "ffn_gate.weight", (shape.ffn, shape.hidden), "Q4_K"),
                 (prefix + "ffn_up.weight", (shape.ffn, shape.hidden), "Q4_K"),
                 (prefix + "ffn_down.weight", (shape.hidden, shape.ffn), extra)]
    plan.append(("output_norm.weight", (shape.hidden,), "norm"))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, shape.hidden), "Q6_K"))
    return plan


def write_file(shape: Shape) -> int:
    """Writes the file; the bytes of its tensors."""
    from gguf import GGMLQuantizationType as T, GGUFWriter

    rng = np.random.default_rng(0)
    partial = shape.path.with_name(shape.path.name + ".partial")  # renamed when whole
    writer = GGUFWriter(partial, "llama")
    add_header(writer, shape)
    from gguf_blocks import random_blocks  # tests/, on the path once add_header has run
    total = 0
    for name, dims, kind in tensor_plan(shape):
        if kind == "norm":
            data = np.ones(dims, dtype=np.float32)
            writer.add_tensor(name, data)
        else:
            data = random_blocks(T[kind], *dims, rng, from_bytes=True)
            writer.add_tensor(name, data, raw_dtype=T[kind])
        total += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(shape.path)
    return total


def _embed_padded_tokenizer(writer, vocab: int) -> None:
    """The tests' small BPE tokenizer, its token list padded with unused tokens to the model's
    vocabulary: llama.cpp wants one token per embedding row (only ids matter here)."""
    import json as json_module

    from tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    backend = json_module.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(backend["model"]["vocab"].items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    types = [3 if t in special else 1 for t in tokens]
    tokens += [f"<|unused_{i}|>" for i in range(vocab - len(tokens))]
    types += [5] * (vocab - len(types))  # llama.cpp's UNUSED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in backend["model"]["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_bos_token_id(tokenizer.bos_token_id)


def pss_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def child(args: argparse.Namespace) -> None:
    import torch

    from pagedgen import LLM, SamplingParams
    from pagedgen.model.runtime.weight_bytes import weight_bytes

    before = pss_bytes()
    start = time.perf_counter()
    llm = LLM(str(SHAPES[args.shape].path), weights="packed", dtype="bfloat16", threads=args.threads,
              kv_memory=256 << 20, block_size=16)
    loaded, load_s = pss_bytes(), time.perf_counter() - start
    prompt = list(range(100, 132))
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False)
    generate_s = time.perf_counter() - start
    after = pss_bytes()
    tokens = len(prompt) + args.new_tokens
    kv_written = -(-tokens // 16) * 16 * llm.runner.kv_bytes_per_token
    held = weight_bytes(llm.runner.model)
    print("RESULT " + json.dumps({
        "pss_before": before, "pss_loaded": loaded, "pss_after": after, "kv_written": kv_written,
        "resident_weights": after - before - kv_written, "gguf_block_bytes": held.gguf_block_bytes,
        "plain_bytes": held.plain_bytes, "load_s": load_s, "generate_s": generate_s,
        "tokens": out[0].outputs[0].token_ids, "threads": torch.get_num_threads()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(ROOT / "peers"))
    from cpu_info import cpu_info
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {cpu_info().summary()}", flush=True)
    shape = SHAPES[args.shape]
    path = random_gguf(args.shape)
    command = [sys.executable, __file__, CHILD, "--shape", args.shape, "--threads",
               str(args.threads), "--new-tokens", str(args.new_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the run failed:\n{done.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    stored = r["gguf_block_bytes"] + r["plain_bytes"]
    gib = 2**30
    print(f"{path.name}: file {path.stat().st_size / gib:.2f} GiB, tensors as held "
          f"{stored / gib:.2f} GiB (GGUF blocks {r['gguf_block_bytes'] / gib:.2f}, plain "
          f"{r['plain_bytes'] / gib:.3f}); PSS before load {r['pss_before'] / gib:.2f} GiB, "
          f"after load {r['pss_loaded'] / gib:.2f}, after generate {r['pss_after'] / gib:.2f} "
          f"(within 8 GiB: {r['pss_after'] <= 8 * gib})", flush=True)
    # The embedding table is read by row, for the step's tokens only: the rest stays on disk
    # (with a tied LM head every row is read, by the head).
    embedding = 0 if shape.tied else shape.vocab * shape.hidden // 256 * EMBEDDING_BLOCK_BYTES
    print(f"resident weights {r['resident_weights'] / gib:.2f} GiB = "
          f"{r['resident_weights'] / stored:.3f}x the tensors, "
          f"{r['resident_weights'] / (stored - embedding):.3f}x those but the embedding table "
          f"({embedding / gib:.2f} GiB, rows looked up per token) (KV written "
          f"{r['kv_written'] / 2**20:.1f} MiB excluded); load {r['load_s']:.1f} s, generate "
          f"({args.new_tokens} new tokens after 32) "
          f"{r['generate_s']:.1f} s, threads {r['threads']}", flush=True)


if __name__ == "__main__":
    main()
