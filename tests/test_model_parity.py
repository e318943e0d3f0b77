"""pagedgen's decoder against transformers (the oracle): greedy tokens and logits.

A small greedy driver stands in for the engine: sequences join one step apart, so steps mix
prefills and decodes in one flat batch, and block tables come from a stand-in allocator whose
block ids are shuffled (a kernel that assumes contiguous blocks gives wrong tokens).
"""
from __future__ import annotations

import functools

import pytest
import torch

from pagedgen.model.runtime.runner import ModelRunner, ScheduledChunk
from pagedgen.settings import EngineConfig
from tiny_models import ARCHITECTURES, sequential_block_tables, tiny_hf_model, tiny_loaded_model

NEW_TOKENS = 10


def prompt_lengths(block_size: int) -> list[int]:
    """1, B-1, B, B+1 and one prompt spanning several blocks."""
    b = block_size
    return [1, b - 1, b, b + 1, 3 * b + 5]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def shuffled_tables(lengths: list[int], block_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Stand-in block tables over a shuffled pool; returns (tables, pool size)."""
    tables = sequential_block_tables(lengths, block_size)
    pool = sum(map(len, tables)) + 2  # spare blocks stay unused
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(seed)).tolist()
    return [[order[b] for b in table] for table in tables], pool


def blocks_for(table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The part of a table a KV manager would have handed out for num_tokens (demand paging)."""
    return table[:-(-num_tokens // block_size)]


def pagedgen_greedy(loaded, prompts: list[list[int]], new_tokens: int, block_size: int) -> list[list[int]]:
    """Greedy generation; sequence i is admitted (prefilled) at step i, then decodes."""
    tables, pool = shuffled_tables([len(p) + new_tokens for p in prompts], block_size)
    runner = ModelRunner(loaded, EngineConfig(block_size=block_size, num_blocks=pool),
                         hybrid_kv=False)  # its own tables: one group
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)  # tokens whose K/V are in the cache
    for step in range(len(prompts) + new_tokens):
        active = [i for i in range(len(prompts)) if i <= step and len(tokens[i]) - len(prompts[i]) < new_tokens]
        chunks = [_next_chunk(tokens[i], computed[i], tables[i], block_size) for i in active]
        if not chunks:
            break
        next_ids = runner.execute(chunks, []).argmax(dim=-1).tolist()
        for i, token in zip(active, next_ids):
            computed[i] = len(tokens[i])
            tokens[i].append(token)
    return [t[len(p):] for t, p in zip(tokens, prompts)]


def _next_chunk(tokens: list[int], computed: int, table: list[int], block_size: int) -> ScheduledChunk:
    return ScheduledChunk(token_ids=tokens[computed:], start_pos=computed,
                          block_table=blocks_for(table, len(tokens), block_size), sample=True)


def transformers_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """generate(do_sample=False) one prompt at a time (no padding in the reference)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@functools.cache
def reference_tokens(arch: str, tied: bool, block_size: int) -> tuple:
    prompts = random_prompts(prompt_lengths(block_size), tiny_loaded_model(arch, tied).config.vocab_size)
    return prompts, transformers_greedy(tiny_hf_model(arch, tied), prompts, NEW_TOKENS)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_equal_transformers(arch, tied, block_size):
    prompts, expected = reference_tokens(arch, tied, block_size)
    got = pagedgen_greedy(tiny_loaded_model(arch, tied), prompts, NEW_TOKENS, block_size)
    assert got == expected


def run_chunks(loaded, prompt: list[int], cuts: list[int], block_size: int = 8) -> torch.Tensor:
    """Prefill `prompt` in chunks ending at `cuts` (the last cut is len(prompt)); stacked logits."""
    tables, pool = shuffled_tables([len(prompt)], block_size, seed=3)
    runner = ModelRunner(loaded, EngineConfig(block_size=block_size, num_blocks=pool),
                         hybrid_kv=False)  # its own tables: one group
    logits, start = [], 0
    for end in cuts:
        chunk = ScheduledChunk(prompt[start:end], start, blocks_for(tables[0], end, block_size), True)
        logits.append(runner.execute([chunk], [])[0])
        start = end
    return torch.stack(logits)


@pytest.mark.parametrize("arch", ["llama3_rope", "qwen3"])
def test_chunked_prefill_matches_one_chunk_and_transformers(arch):
    loaded = tiny_loaded_model(arch)
    prompt = random_prompts([29], loaded.config.vocab_size, seed=5)[0]
    cuts = [5, 16, 29]  # chunk edges inside and on block boundaries (B = 8)
    whole = run_chunks(loaded, prompt, [29])[0]
    chunked = run_chunks(loaded, prompt, cuts)
    with torch.no_grad():
        hf_logits = tiny_hf_model(arch)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(chunked[-1], whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, hf_logits[[c - 1 for c in cuts]], atol=1e-4, rtol=1e-4)


def test_prefill_after_cached_prefix_reuses_blocks():
    """Sequence B shares A's first two full blocks (a prefix-cache hit) and computes only its
    own tail: its logits equal B computed from scratch, and A's blocks are not rewritten."""
    loaded, block_size = tiny_loaded_model("qwen2"), 8
    shared = random_prompts([2 * block_size], loaded.config.vocab_size, seed=7)[0]
    prompt_a, prompt_b = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]
    runner = ModelRunner(loaded, EngineConfig(block_size=block_size, num_blocks=8))
    table_a, table_b = [5, 2, 7], [5, 2, 0]  # B maps its first two blocks to A's
    runner.execute([ScheduledChunk(prompt_a, 0, table_a, True)], [])
    cached_blocks = runner.kv_cache[:, :, [5, 2]].clone()
    tail = runner.execute([ScheduledChunk(prompt_b[16:], 16, table_b, True)], [])[0]
    fresh_runner = ModelRunner(loaded, EngineConfig(block_size=block_size, num_blocks=8))
    fresh = fresh_runner.execute([ScheduledChunk(prompt_b, 0, [1, 3, 4], True)], [])[0]
    torch.testing.assert_close(tail, fresh, atol=1e-5, rtol=1e-5)
    assert torch.equal(runner.kv_cache[:, :, [5, 2]], cached_blocks)


def test_logits_only_for_sampled_chunks_in_batch_order():
    loaded, block_size = tiny_loaded_model("mistral"), 8
    prompts = random_prompts([3, 12, 5], loaded.config.vocab_size, seed=9)
    tables, pool = shuffled_tables([len(p) for p in prompts], block_size)
    runner = ModelRunner(loaded, EngineConfig(block_size=block_size, num_blocks=pool),
                         hybrid_kv=False)  # its own tables: one group
    chunks = [ScheduledChunk(p, 0, t, sample) for p, t, sample in zip(prompts, tables, [True, False, True])]
    logits = runner.execute(chunks, [])
    hf = tiny_hf_model("mistral")
    with torch.no_grad():
        expected = [hf(torch.tensor([p])).logits[0, -1] for p in (prompts[0], prompts[2])]
    assert logits.shape == (2, loaded.config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, torch.stack(expected), atol=1e-4, rtol=1e-4)


# --- the built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF) --------------------------

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                   "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def default_pair():
    """(pagedgen's LoadedModel, transformers' model + tokenizer) of the same GGUF file, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedgen.model.loading.default_model import default_model_path
    from pagedgen.model.loading.loader import load_model

    path = default_model_path()
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 2
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers dequantizes the file: compare the same weights (the packed int8 path is
    # checked against this one in test_gguf_real_model.py)
    return load_model(None, dtype="float32", weights="dequantized"), hf_model, hf_tokenizer


def test_default_model_greedy_equals_transformers(default_pair):
    loaded, hf_model, hf_tokenizer = default_pair
    prompts = [loaded.tokenizer(text).input_ids for text in DEFAULT_PROMPTS]
    assert prompts == [hf_tokenizer(text).input_ids for text in DEFAULT_PROMPTS]
    got = pagedgen_greedy(loaded, prompts, 32, block_size=16)
    assert got == transformers_greedy(hf_model, prompts, 32)
    assert loaded.tokenizer.decode(got[0]).startswith(" Paris.")
    assert loaded.eos_token_ids == [loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>" in loaded.tokenizer.chat_template
