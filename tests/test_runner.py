"""ModelRunner: flat-batch metadata, KV cache sizing, copy-on-write, kernel paths, bad input."""
from __future__ import annotations

import pytest
import torch

from pagedgen.model.runtime import kv_cache as kv
from pagedgen.model.runtime.batch import build_flat_batch
from pagedgen.model.runtime.runner import ModelRunner, ScheduledChunk
from pagedgen.settings import EngineConfig
from tiny_models import tiny_loaded_model


def per_token_reference(chunks, block_size):
    """The obvious per-token loops the runner must not use, as the oracle for its tensor ops."""
    positions, slots = [], []
    for chunk in chunks:
        for offset in range(len(chunk.token_ids)):
            pos = chunk.start_pos + offset
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
    return positions, slots


def mixed_chunks() -> list[ScheduledChunk]:
    return [
        ScheduledChunk([5, 6, 7], 0, [4], True),  # fresh prefill inside one block
        ScheduledChunk([9], 12, [2, 7], True),  # decode at offset 4 of its second block
        ScheduledChunk(list(range(10, 21)), 5, [1, 3], False),  # chunk after 5 cached tokens
        ScheduledChunk([3], 8, [6, 0], True),  # decode opening a new block (block id 0)
    ]


def test_flat_batch_matches_per_token_reference():
    chunks, block_size = mixed_chunks(), 8
    flat = build_flat_batch(chunks, block_size)
    positions, slots = per_token_reference(chunks, block_size)
    assert flat.positions.tolist() == positions
    assert flat.slot_mapping.tolist() == slots
    assert flat.input_ids.tolist() == [t for c in chunks for t in c.token_ids]
    assert flat.query_start_loc.tolist() == [0, 3, 4, 15, 16]
    assert flat.seq_lens.tolist() == [3, 13, 16, 9]
    assert flat.block_tables.tolist() == [[4, 0], [2, 7], [1, 3], [6, 0]]
    assert flat.sample_rows.tolist() == [2, 3, 15]  # chunk 2 (sample=False) has no row
    assert flat.block_tables.dtype == flat.seq_lens.dtype == flat.query_start_loc.dtype == torch.int32


@pytest.mark.parametrize("chunk,message", [
    (ScheduledChunk([], 0, [0], True), "token_ids must not be empty"),
    (ScheduledChunk([1], -1, [0], True), "start_pos must be >= 0"),
    (ScheduledChunk([1] * 9, 0, [0], True), "block_table"),
    (ScheduledChunk([1], 8, [0], True), "block_table"),
])
def test_flat_batch_rejects_bad_chunks_naming_the_field(chunk, message):
    with pytest.raises(ValueError, match=message) as error:
        build_flat_batch([ScheduledChunk([1], 0, [0], True), chunk], 8)
    assert "#1" in str(error.value)


def test_runner_rejects_ids_out_of_range():
    runner = ModelRunner(tiny_loaded_model(), EngineConfig(block_size=8, num_blocks=4))
    with pytest.raises(ValueError, match="block_table holds a block id outside"):
        runner.execute([ScheduledChunk([1, 2], 0, [4], True)], [])
    with pytest.raises(ValueError, match="token_ids must be in"):
        runner.execute([ScheduledChunk([1, 512], 0, [0], True)], [])
    with pytest.raises(ValueError, match="copies holds a block id"):
        runner.execute([], [(0, 9)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(tiny_loaded_model(), EngineConfig(block_size=8, num_blocks=70)).execute(
            [ScheduledChunk([1], 512, list(range(65)), True)], [])


def test_kv_cache_layout_and_dtype_follow_the_model():
    loaded = tiny_loaded_model("qwen3", dtype=torch.bfloat16)
    runner = ModelRunner(loaded, EngineConfig(block_size=16, num_blocks=5))
    cfg = loaded.config
    assert runner.kv_cache.shape == (cfg.num_layers, 2, 5, 16, cfg.num_kv_heads, cfg.head_dim)
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.dtype == torch.bfloat16
    assert runner.kv_cache_bytes == 5 * 16 * cfg.kv_bytes_per_token(torch.bfloat16)


def test_kv_cache_starts_zeroed_even_on_recycled_memory():
    """Kernels gather whole blocks and mask the tail; a NaN left in memory by an earlier
    tensor would survive the mask (0 * NaN) and poison the logits."""
    garbage = torch.full((2, 2, 6, 8, 2, 16), float("nan"))  # exactly the pool's size
    del garbage
    runner = ModelRunner(tiny_loaded_model(), EngineConfig(block_size=8, num_blocks=6))
    assert torch.count_nonzero(runner.kv_cache) == 0


def test_sizing_arithmetic():
    # SmolLM2-135M: 30 layers, 3 kv heads of 64 -> 2 * 30 * 3 * 64 * 2 bytes in bf16
    assert kv.kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 23040
    assert kv.kv_bytes_per_token(30, 3, 64, "float32") == 46080
    assert kv.blocks_for_budget(23040 * 16 * 10 + 5, 16, 23040) == 10
    assert kv.blocks_for_budget(100, 16, 23040) == 0


def test_runner_sizes_pool_from_bytes_or_free_memory_fraction(monkeypatch):
    loaded = tiny_loaded_model()
    per_block = 8 * loaded.config.kv_bytes_per_token(torch.float32)  # 8 * 2*2*2*16*4 = 4096
    assert ModelRunner(loaded, EngineConfig(block_size=8, kv_memory=per_block * 7 + 1)).num_blocks == 7
    # Without a size, CPU gets a fixed budget (CUDA would take a share of free memory).
    assert ModelRunner(loaded, EngineConfig(block_size=8)).num_blocks == kv.DEFAULT_KV_MEMORY_BYTES // per_block
    monkeypatch.setattr(kv, "available_memory_bytes", lambda device: per_block * 100)
    assert ModelRunner(loaded, EngineConfig(block_size=8), kv_memory_fraction=0.25).num_blocks == 25


def test_a_pool_larger_than_available_memory_is_refused_with_what_fits(monkeypatch):
    loaded = tiny_loaded_model()
    per_block = 8 * loaded.config.kv_bytes_per_token(torch.float32)
    monkeypatch.setattr(kv, "available_memory_bytes", lambda device: per_block * 100 + 5)
    assert ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=100)).num_blocks == 100
    for size in (dict(num_blocks=101), dict(kv_memory=per_block * 150)):
        with pytest.raises(ValueError, match=rf"largest pool that fits is 100 blocks \({per_block * 100} bytes\)"):
            ModelRunner(loaded, EngineConfig(block_size=8, **size))


def test_llm_refuses_an_impossible_pool_before_allocating_it():
    from pagedgen import LLM
    from tiny_models import tiny_model_dir

    # 10**9 blocks of 16 tokens x 512 bytes: about 8 TB, more than any machine here has.
    with pytest.raises(ValueError, match="is larger than the .* bytes available on cpu; the largest pool"):
        LLM(str(tiny_model_dir()), dtype="float32", device="cpu", num_blocks=10**9)


def test_cpu_free_memory_is_read_from_meminfo():
    available = kv.available_memory_bytes("cpu")
    assert 0 < available <= _meminfo_total_bytes()


def _meminfo_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        return int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_blocks=4, kv_memory=10**6), "give num_blocks or kv_memory, not both"),
    (dict(num_blocks=0), "num_blocks must be an integer >= 1, got 0"),
    (dict(kv_memory=100), "less than one KV block"),
])
def test_runner_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelRunner(tiny_loaded_model(), EngineConfig(block_size=8, **kwargs))


def test_runner_rejects_a_bad_memory_fraction():
    with pytest.raises(ValueError, match=r"kv_memory_fraction must be in \(0, 1\]"):
        ModelRunner(tiny_loaded_model(), EngineConfig(block_size=8), kv_memory_fraction=1.5)


def test_copy_on_write_happens_before_the_forward():
    """A forked child writes into a copy of the shared partial block: decoding through the
    copy (made in the same execute call) must give the parent's logits."""
    loaded, prompt = tiny_loaded_model("llama"), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    runner = ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=6))
    runner.execute([ScheduledChunk(prompt, 0, [1, 2], True)], [])  # block 2 is half full
    child = runner.execute([ScheduledChunk([40], 12, [1, 3], True)], [(2, 3)])
    parent = runner.execute([ScheduledChunk([40], 12, [1, 2], True)], [])
    torch.testing.assert_close(child, parent, atol=0, rtol=0)
    without_copy = ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=6))
    without_copy.kv_cache.zero_()
    without_copy.execute([ScheduledChunk(prompt, 0, [1, 2], True)], [])
    assert not torch.allclose(without_copy.execute([ScheduledChunk([40], 12, [1, 3], True)], []), parent)


def test_empty_batch_returns_no_logits():
    runner = ModelRunner(tiny_loaded_model(), EngineConfig(block_size=8, num_blocks=2))
    assert runner.execute([], []).shape == (0, 512)


def test_triton_kernels_give_the_same_logits_as_torch_kernels():
    """The CUDA path's kernels, run by the Triton interpreter on CPU, through the same model."""
    from pagedgen.kernels.cpu import backend as cpu_backend
    from pagedgen.kernels.triton import ops as triton_ops

    loaded = tiny_loaded_model("qwen2")
    steps = [[ScheduledChunk(list(range(3, 22)), 0, [2, 0, 3], True), ScheduledChunk([5], 0, [1], True)],
             [ScheduledChunk([30], 19, [2, 0, 3], True), ScheduledChunk([6, 7, 8], 1, [1], True)]]
    logits = {}
    for ops in (cpu_backend, triton_ops):
        runner = ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=4), kernels=ops)
        logits[ops] = [runner.execute(chunks, []) for chunks in steps]
    for expected, got in zip(logits[cpu_backend], logits[triton_ops]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_model_tracks_float32():
    chunks = [ScheduledChunk(list(range(3, 40)), 0, [0, 1, 2], True)]
    ref = ModelRunner(tiny_loaded_model("llama"), EngineConfig(block_size=16, num_blocks=3)).execute(chunks, [])
    bf16 = ModelRunner(tiny_loaded_model("llama", dtype=torch.bfloat16), EngineConfig(block_size=16, num_blocks=3)).execute(chunks, [])
    assert bf16.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(bf16, ref).item() > 0.99
