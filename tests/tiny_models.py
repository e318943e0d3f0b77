"""Tiny random models and an offline tokenizer, built at test time (nothing downloaded).

Shared by every test file that needs a model:

    from tiny_models import tiny_loaded_model, tiny_model_dir, tiny_tokenizer   # conftest: tests/ on sys.path
    loaded = tiny_loaded_model("llama")                 # pagedgen LoadedModel, float32
    folder = tiny_model_dir("qwen3", tied=True)          # HF folder: config + safetensors + tokenizer
    hf = tiny_hf_model("mistral")                        # the transformers model of that folder
    long = tiny_model_dir("llama", max_position_embeddings=2048)   # room for longer prompts

Everything is cached per process (xdist workers each build their own, in a temp folder removed
at exit). Import it only as `tiny_models`, never `tests.tiny_models`: a second module object
would have its own caches and build every model again. Building a model folder takes well under a second; the tokenizer ~0.1 s.
Weights are random but deterministic (seeded), with norms and biases perturbed away from
their 1/0 init so that loading them wrongly changes the output.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch

if __name__ != "tiny_models":  # e.g. `tests.tiny_models`: a second copy with caches of its own
    raise ImportError(f"import this module as `tiny_models` (conftest puts tests/ on sys.path), "
                      f"not as `{__name__}`")

ARCHITECTURES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")
# Models whose layers slide (windows far shorter than the tests' contexts):
#   gemma3         Gemma 3's real layer pattern (5 sliding, 1 global; 8 layers), 4 query heads
#                  per KV head as at 270M/1B, window 16;
#   gemma3_hd256   head_dim 256, 2 query heads per KV head, window 32, the global layers' RoPE
#                  scaled (linear, as from 4B up), layer_types listed explicitly;
#   mistral_window every layer sliding, window 24;
#   qwen2_window   use_sliding_window from max_window_layers = 1 on, window 20.
SLIDING_ARCHITECTURES = ("gemma3", "gemma3_hd256", "mistral_window", "qwen2_window")
WINDOWS = {"gemma3": 16, "gemma3_hd256": 32, "mistral_window": 24, "qwen2_window": 20}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
TOKENIZER_VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Small stdlib modules with English prose and code: a varied corpus present on every machine.
_CORPUS_MODULES = ("textwrap.py", "string.py", "glob.py", "fnmatch.py", "this.py")

MAX_POSITIONS = 512
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.1)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@functools.cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="pagedgen-tiny-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def tiny_tokenizer():
    """Byte-level BPE (512 tokens) trained on a few stdlib files, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train([str(stdlib / name) for name in _CORPUS_MODULES], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN,
                                   pad_token="<|endoftext|>", bos_token="<|im_start|>",
                                   chat_template=CHAT_TEMPLATE)


def hf_config(arch: str, tied: bool = False, max_position_embeddings: int = MAX_POSITIONS):
    """The transformers config of a tiny model of `arch` (one of ARCHITECTURES)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    tokenizer = tiny_tokenizer()
    ids = dict(vocab_size=len(tokenizer), tie_word_embeddings=tied,
               max_position_embeddings=max_position_embeddings,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)
    if arch == "llama":
        return LlamaConfig(**_COMMON, **ids)
    if arch == "llama3_rope":
        return LlamaConfig(**_COMMON, **ids, rope_parameters=dict(_LLAMA3_ROPE))
    if arch == "mistral":
        return MistralConfig(**_COMMON, **ids, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, **ids)
    if arch == "qwen3":
        return Qwen3Config(**_COMMON, **ids, head_dim=32)  # head_dim != hidden / heads, as in Qwen3
    if arch == "mistral_window":
        return MistralConfig(**_COMMON, **ids, sliding_window=WINDOWS[arch])
    if arch == "qwen2_window":
        return Qwen2Config(**{**_COMMON, "num_hidden_layers": 3}, **ids, use_sliding_window=True,
                           sliding_window=WINDOWS[arch], max_window_layers=1)
    if arch.startswith("gemma3"):
        return _gemma3_config(arch, ids)
    raise ValueError(f"arch must be one of {ARCHITECTURES + SLIDING_ARCHITECTURES}, got {arch!r}")


def _gemma3_config(arch: str, ids: dict):
    from transformers import Gemma3TextConfig

    common = dict(hidden_size=64, intermediate_size=128, rms_norm_eps=1e-6, initializer_range=0.1,
                  sliding_window=WINDOWS[arch], **{**ids, "tie_word_embeddings": True})
    if arch == "gemma3":   # layer_types from the pattern, as Gemma3TextConfig builds them
        return Gemma3TextConfig(**common, num_hidden_layers=8, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32)
    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return Gemma3TextConfig(**common, num_hidden_layers=4, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                            layer_types=types, rope_parameters=rope)


@functools.cache
def tiny_model_dir(arch: str = "llama", tied: bool = False, seed: int = 0,
                   max_position_embeddings: int = MAX_POSITIONS) -> Path:
    """An HF model folder (float32 safetensors, config, tokenizer) of a tiny random model."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar is noise in test logs
    torch.manual_seed(seed)
    config = hf_config(arch, tied, max_position_embeddings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model, seed)
    model.generation_config.eos_token_id = None  # see tiny_hf_model
    folder = _workdir() / f"{arch}-{'tied' if tied else 'untied'}-{seed}-{max_position_embeddings}"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _perturb_norms_and_biases(model, seed: int) -> None:
    """Init leaves norms at 1 and biases at 0; random values make a mis-loaded one visible."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=gen))


@functools.cache
def tiny_hf_model(arch: str = "llama", tied: bool = False, seed: int = 0,
                  max_position_embeddings: int = MAX_POSITIONS):
    """transformers' model of tiny_model_dir(...), float32, eval, never stopping early.

    generation_config.eos_token_id = None (with a pad id) makes generate() behave like
    ignore_eos without masking the EOS logit (min_new_tokens would change the argmax).
    """
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(arch, tied, seed, max_position_embeddings)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tiny_tokenizer().pad_token_id
    return model.eval()


@functools.cache
def tiny_loaded_model(arch: str = "llama", tied: bool = False, dtype: torch.dtype = torch.float32,
                      seed: int = 0, max_position_embeddings: int = MAX_POSITIONS):
    """pagedgen's LoadedModel of tiny_model_dir(...) on CPU. Shared: do not modify it. A runner
    packs its weights (float32 ones then live in the packing alone): to read them, see
    unpacked_tiny_model."""
    return unpacked_tiny_model(arch, tied, dtype, seed, max_position_embeddings)


def unpacked_tiny_model(arch: str = "llama", tied: bool = False, dtype: torch.dtype = torch.float32,
                        seed: int = 0, max_position_embeddings: int = MAX_POSITIONS):
    """A LoadedModel of its own, as loaded: no runner has packed its weights."""
    from pagedgen.model.loading.loader import load_model

    folder = tiny_model_dir(arch, tied, seed, max_position_embeddings)
    return load_model(str(folder), dtype=dtype, device="cpu")


def sequential_block_tables(lengths: list[int], block_size: int, first_block: int = 0) -> list[list[int]]:
    """A stand-in for the KV manager: sequence s gets the next ceil(len/B) block ids in order."""
    tables, next_block = [], first_block
    for length in lengths:
        count = -(-length // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables


# llama.cpp's tensor names for the HF names of a Llama-family checkpoint (GGUF test files).
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_tiny_run_config(path: Path, max_tokens: int = 3) -> Path:
    """The YAML config the CLI tests run with: the tiny llama, float32 on CPU, a small pool,
    greedy completions of `max_tokens` that ignore EOS (so every run's length is known)."""
    path.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                    "num_blocks: 64\nmax_num_seqs: 4\nmax_model_len: 64\nthreads: 1\n"
                    f"sampling:\n  max_tokens: {max_tokens}\n  temperature: 0\n  ignore_eos: true\n")
    return path
