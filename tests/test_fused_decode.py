"""The one-call decode step (kernels/cpu/decode_step.c via pagedgen/model/layers/fused_decode.py) gives
bit-identical logits and KV cache (8-bit pools: codes and scales) to running the layers one
module at a time, Llama family and Gemma 3 (on its hybrid KV pool too), on weights packed for
our GEMMs and on GGUF blocks as stored, and steps it does not cover (prefill chunks, more rows
than the projections' kernels take) still run the layers."""
from __future__ import annotations

import pytest
import torch

from pagedgen.engine.kv_manager import NULL_BLOCK
from pagedgen.kernels.cpu import native
from pagedgen.kernels.cpu.gguf import build as gguf_build

from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.runner import ModelRunner, ScheduledChunk
from pagedgen.settings import EngineConfig
from pagedgen.model.layers import quantized_linear as ql
from test_gguf_gemm import tiles_in_form
from test_gguf_packed_model import write_quantized_gguf
from tiny_models import WINDOWS, sequential_block_tables, tiny_model_dir

BLOCK_SIZE = 8
PROMPT_LENGTHS = [1, 7, 8, 20]  # a lone token, block size -1, +0, several blocks


def _runner(model_path: str | None, kv_cache_dtype: str = "auto", hybrid_kv: bool = True,
            num_blocks: int = 64, weights: str = "dequantized") -> ModelRunner:
    """weights: a GGUF file's (the default model's) matrices dequantized for our bf16 GEMM, or
    "packed": its blocks as stored."""
    loaded = load_model(model_path, dtype=torch.bfloat16, device="cpu",  # private: we toggle it
                        weights=weights)
    runner = ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                              kv_cache_dtype=kv_cache_dtype), hybrid_kv=hybrid_kv)
    if runner.model.fused_decode is None:
        pytest.skip("no fused decode here (needs the native kernels and AMX, AVX-512 BF16 or AVX2)")
    kind = "gguf" if weights == "packed" else native.gemm_kind()
    assert runner.model.fused_decode.gemm_kind == kind
    return runner


class _Spy:
    """Stands in for the model's FusedDecode and records what each call returned."""

    def __init__(self, fused):
        self.fused, self.results = fused, []

    def run(self, *args):
        self.results.append(self.fused.run(*args))
        return self.results[-1]


def _generate(runner: ModelRunner, fused: bool, steps: int = 5, lengths=PROMPT_LENGTHS):
    """Prefill, then greedy decode steps: every step's logits, the final cache, the spy."""
    saved = runner.model.fused_decode
    spy = _Spy(saved)
    runner.model.fused_decode = spy if fused else None
    runner.kv_cache.view(torch.uint8).zero_()
    if runner.kv_scales is not None:
        runner.kv_scales.zero_()
    lengths = list(lengths)
    tables = sequential_block_tables([n + steps for n in lengths], BLOCK_SIZE)
    prompts = [[(7 * s + 3 * t) % 100 + 1 for t in range(n)] for s, n in enumerate(lengths)]
    logits = [runner.execute([ScheduledChunk(p, 0, table, True)
                              for p, table in zip(prompts, tables)], [])]
    for _ in range(steps):
        tokens = logits[-1].argmax(-1).tolist()
        batch = [ScheduledChunk([token], n, table, True)
                 for token, n, table in zip(tokens, lengths, tables)]
        logits.append(runner.execute(batch, []))
        lengths = [n + 1 for n in lengths]
    runner.model.fused_decode = saved
    scales = None if runner.kv_scales is None else runner.kv_scales.clone()
    return logits, (runner.kv_cache.view(torch.uint8).clone(), scales), spy


def _assert_fused_equals_layers(runner, lengths=PROMPT_LENGTHS, covered=True):
    """The same greedy run fused and layer by layer: the prefill step not covered (None), every
    decode step covered (or none: covered=False), logits and K/V (an 8-bit pool's scales too)
    bit-identical. Returns the fused run's logits and cache."""
    fused_logits, fused_cache, spy = _generate(runner, fused=True, lengths=lengths)
    layer_logits, layer_cache, _ = _generate(runner, fused=False, lengths=lengths)
    decodes = [covered] * (len(fused_logits) - 1)
    assert [r is not None for r in spy.results] == [False] + decodes
    for fused, layered in zip(fused_logits, layer_logits):
        assert torch.equal(fused, layered)
    assert torch.equal(fused_cache[0], layer_cache[0])
    if fused_cache[1] is not None:
        assert torch.equal(fused_cache[1], layer_cache[1])
    return fused_logits, fused_cache


@pytest.mark.parametrize("model, kv_cache_dtype", [
    ("tiny", "auto"), ("default", "auto"), ("default-packed", "auto"),
    ("tiny", "int8"), ("tiny", "fp8_e4m3"), ("tiny", "fp8_e5m2"), ("default", "int8"),
    ("default-packed", "int8")])
def test_fused_decode_is_bit_identical_to_the_layers(model, kv_cache_dtype):
    # tiny: head_dim 16 (the portable attention loop); default: SmolLM2, head_dim 64 (AVX-512),
    # dequantized for our bf16 GEMM or (default-packed) its Q4_1/Q8_0 blocks as stored.
    # 8-bit pools: the codes and their scales (re-quantized as blocks fill) must match too.
    path = str(tiny_model_dir("llama")) if model == "tiny" else None
    runner = _runner(path, kv_cache_dtype,
                     weights="packed" if model == "default-packed" else "dequantized")
    _assert_fused_equals_layers(runner)


@pytest.mark.parametrize("form", [0, 1], ids=["vdpbf16ps", "float32-fma"])
def test_fused_decode_on_gguf_blocks_is_bit_identical_to_the_layers(tmp_path, form):
    """Packed GGUF projections (q/k read through a row map, Q4_0/Q4_1/Q5_0/Q8_0 parts): decode
    batches on the int8 kernel (fewer rows than tiles_min_rows()) and on the bf16 tiles, in
    each of their forms, where the library has them; from the dequantize crossover on, the
    layers run."""
    library = gguf_build.best()
    if library is None:
        pytest.skip("no GGUF library here (needs a C compiler)")
    with tiles_in_form(library, form):
        loaded = load_model(str(write_quantized_gguf(tmp_path / "q.gguf")), dtype=torch.bfloat16,
                            device="cpu", weights="packed")
        runner = ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=512))
        fused = runner.model.fused_decode
        if fused is None:
            pytest.skip("no fused decode here (needs the native kernels)")
        assert fused.gemm_kind == "gguf"
        assert fused.max_rows == ql.dequantize_min_rows(library) - 1
        _assert_fused_equals_layers(runner, [7, 20])
        _assert_fused_equals_layers(runner, PROMPT_LENGTHS + [3, 30])
        if fused.max_rows < 256:  # the float32 tiles take every step the dense GEMM would
            _assert_fused_equals_layers(runner, [1 + n % 9 for n in range(fused.max_rows + 1)],
                                        covered=False)


def test_fused_decode_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("PAGEDGEN_FUSED_DECODE", "0")
    loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16, device="cpu")
    ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=8))
    assert loaded.model.fused_decode is None


def test_no_fused_decode_on_onednn_packed_weights(monkeypatch):
    monkeypatch.setenv("PAGEDGEN_NATIVE_GEMM", "0")  # projections through torch's oneDNN
    loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16, device="cpu")
    ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=8))
    assert loaded.model.fused_decode is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_outputs_do_not_depend_on_the_fused_step(monkeypatch, kv_cache_dtype):
    # The whole engine on the default model in bf16: sampling with n=3 (shared prompt blocks,
    # copy-on-write) and a pool small enough to preempt; same seeds -> same texts either way.
    from pagedgen import LLM, SamplingParams

    if native.gemm_kind() is None:
        pytest.skip("no fused decode here (needs the native kernels and AMX, AVX-512 BF16 or AVX2)")
    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=20, seed=7)
    texts, preemptions = {}, {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDGEN_FUSED_DECODE", fused)
        llm = LLM(threads=1, dtype="bfloat16", num_blocks=6, block_size=16,
                  kv_cache_dtype=kv_cache_dtype)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        texts[fused] = [[sample.text for sample in out.outputs] for out in outputs]
        preemptions[fused] = llm.memory_report()["summary"]["preemptions"]
    assert preemptions["1"] > 0
    assert texts["1"] == texts["0"]


def _with_window(monkeypatch, window: int) -> None:
    """Every layer attends with a sliding window (what a Mistral config's layers do): the
    step's plan carries it and the per-layer path passes it on."""
    from pagedgen.kernels.cpu import backend
    plan, attend = backend.plan_attention, backend.paged_attention
    monkeypatch.setattr(backend, "plan_attention",
                        lambda *args: plan(*args[:4], window))
    monkeypatch.setattr(backend, "paged_attention", lambda *args, plan=None, **kwargs: attend(
        *args, plan=plan, sliding_window=plan.sliding_window, **kwargs))


@pytest.mark.parametrize("model, kv_cache_dtype", [
    ("tiny", "auto"), ("default", "auto"), ("tiny", "int8"), ("default", "int8")])
def test_fused_decode_with_a_sliding_window_is_bit_identical_to_the_layers(
        model, kv_cache_dtype, monkeypatch):
    runner = _runner(str(tiny_model_dir("llama")) if model == "tiny" else None, kv_cache_dtype)
    full_logits, _, _ = _generate(runner, fused=True)
    _with_window(monkeypatch, 5)  # shorter than most prompts, not a multiple of the block
    fused_logits, _ = _assert_fused_equals_layers(runner)
    assert not torch.equal(full_logits[-1], fused_logits[-1])  # the window changed the result


def test_fused_decode_per_layer_windows_need_unshifted_tables():
    runner = _runner(str(tiny_model_dir("llama")))
    fused = runner.model.fused_decode
    layers = len(fused.layers)
    mixed = type(fused).build(runner.model.config, runner.model.layers, [0, 5] * (layers // 2)
                              + [0] * (layers % 2))
    assert mixed is not None
    assert torch.equal(mixed._windows(0), mixed.layer_windows)
    assert mixed._windows(5) is None  # tables shifted to a window of 5 would cut layer 0 short
    with pytest.raises(ValueError, match="layer_windows"):
        type(fused).build(runner.model.config, runner.model.layers, [0] * (layers + 1))


def test_fused_decode_of_a_sliding_model_is_bit_identical_to_its_layers():
    # Mistral's config: every layer slides (window 24); contexts grow from 20 to 25, so the
    # last steps reach past the window. The decoder hands the fused step its layers' windows.
    runner = _runner(str(tiny_model_dir("mistral_window")))
    assert runner.model.fused_decode.layer_windows.tolist() == [24, 24]
    _assert_fused_equals_layers(runner)


# --- Sliding layers over pools whose windows released blocks; Gemma 3 (offset and sandwich
# norms, q/k norms, GeGLU, two RoPEs, query_pre_attn_scalar) ---

POISON_PAGE = 0  # no sequence gets it and it holds NaN: a read of a released entry shows


def _sliding_runner(arch: str, kv_cache_dtype: str = "auto", hybrid_kv: bool = True) -> ModelRunner:
    """A runner of a tiny model with sliding layers, its fused step holding every layer's
    window (and for Gemma each layer's RoPE: local and global differ)."""
    runner = _runner(str(tiny_model_dir(arch)), kv_cache_dtype, hybrid_kv, num_blocks=128)
    fused = runner.model.fused_decode
    assert fused.layer_windows.tolist() == [runner.model.config.window_of(layer)
                                            for layer in range(len(fused.layers))]
    if arch.startswith("gemma3"):
        assert fused.layer_ropes is not None and len(set(fused.layer_ropes.tolist())) == 2
    return runner


def _group_pages(num_groups: int, lengths: list[int]) -> list[list[list[int]]]:
    """Per sequence, per KV group, pages of its own (a page belongs to one group at a time:
    the layers of different groups at one position share the memory); none is POISON_PAGE."""
    tables, next_page = [], POISON_PAGE + 1
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        tables.append([list(range(next_page + g * count, next_page + (g + 1) * count))
                       for g in range(num_groups)])
        next_page += num_groups * count
    return tables


def _chunk_tables(pages: list[list[int]], windows: tuple[int, ...], start: int,
                  end: int) -> list[list[int]]:
    """Each group's table for a chunk of positions [start, end), as the KV manager gives it:
    in a sliding group the blocks wholly before the first query's window are released."""
    count = -(-end // BLOCK_SIZE)
    tables = []
    for table, window in zip(pages, windows):
        released = max(0, start - window + 1) // BLOCK_SIZE if window else 0
        tables.append([NULL_BLOCK] * released + table[released:count])
    return tables


def _poison_released_page(runner: ModelRunner) -> None:
    runner.kv_cache.view(torch.uint8).zero_()
    if runner.kv_scales is None:
        runner.kv_cache[:, :, POISON_PAGE] = float("nan")
    else:  # codes 0 times a NaN scale
        runner.kv_scales.zero_()
        runner.kv_scales[:, :, POISON_PAGE] = float("nan")


def _generate_released(runner: ModelRunner, fused: bool, lengths: list[int], steps: int = 6):
    """_generate with a table per KV group: prefill, then greedy decode steps whose sliding
    groups' tables have their blocks before the window released (NULL_BLOCK, read as
    POISON_PAGE)."""
    saved = runner.model.fused_decode
    spy = _Spy(saved)
    runner.model.fused_decode = spy if fused else None
    _poison_released_page(runner)
    windows = runner.kv_layout.group_windows
    pages = _group_pages(len(windows), [n + steps for n in lengths])
    prompts = [[(7 * s + 3 * t) % 100 + 1 for t in range(n)] for s, n in enumerate(lengths)]

    def chunk(tokens: list[int], start: int, seq_pages: list[list[int]]) -> ScheduledChunk:
        tables = _chunk_tables(seq_pages, windows, start, start + len(tokens))
        return ScheduledChunk(tokens, start, tables[0], True, group_tables=tables)

    logits = [runner.execute([chunk(p, 0, s) for p, s in zip(prompts, pages)], [])]
    released = 0
    for _ in range(steps):
        tokens = logits[-1].argmax(-1).tolist()
        batch = [chunk([token], n, s) for token, n, s in zip(tokens, lengths, pages)]
        released += sum(table.count(NULL_BLOCK) for c in batch for table in c.group_tables)
        logits.append(runner.execute(batch, []))
        lengths = [n + 1 for n in lengths]
    runner.model.fused_decode = saved
    assert released > 0  # the windows did release blocks
    scales = None if runner.kv_scales is None else runner.kv_scales.clone().view(torch.int32)
    return logits, (runner.kv_cache.view(torch.uint8).clone(), scales), spy


@pytest.mark.parametrize("arch, kv_cache_dtype", [
    ("gemma3", "auto"), ("gemma3", "int8"), ("gemma3", "fp8_e4m3"),
    ("gemma3_hd256", "auto"), ("gemma3_hd256", "int8"), ("qwen2_window", "auto"),
    ("mistral_window", "auto")])
def test_fused_step_on_a_pool_with_released_blocks_is_bit_identical_to_the_layers(
        arch, kv_cache_dtype):
    # gemma3: head_dim 32, 4 query heads per KV head, window 16, one full group and seven
    # sliding ones; gemma3_hd256: head_dim 256 (the AVX-512 kernel's specialisation), window
    # 32; qwen2_window: a full layer and two sliding ones (hybrid too); mistral_window: one
    # sliding group. Four sequences, two of them past the window while decoding.
    runner = _sliding_runner(arch, kv_cache_dtype)
    assert runner.kv_layout.is_hybrid == (arch != "mistral_window")
    window = WINDOWS[arch]
    lengths = [1, 7, window + 4, 2 * window + 5]
    fused_logits, fused_cache, spy = _generate_released(runner, True, lengths)
    layer_logits, layer_cache, _ = _generate_released(runner, False, lengths)
    assert [r is not None for r in spy.results] == [False] + [True] * (len(fused_logits) - 1)
    for fused, layered in zip(fused_logits, layer_logits):
        assert bool(torch.isfinite(fused).all())  # no released (poisoned) block was read
        assert torch.equal(fused, layered)
    assert torch.equal(fused_cache[0], layer_cache[0])
    if fused_cache[1] is not None:
        assert torch.equal(fused_cache[1], layer_cache[1])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_fused_gemma_on_a_one_group_pool_is_bit_identical_to_the_layers(kv_cache_dtype):
    # Every layer keeps every block (hybrid_kv=False): the sliding layers' windows apply
    # through per-layer windows on one set of tables; contexts grow past the window of 16.
    runner = _sliding_runner("gemma3", kv_cache_dtype, hybrid_kv=False)
    assert not runner.kv_layout.is_hybrid
    _assert_fused_equals_layers(runner)


def test_gemma_engine_outputs_do_not_depend_on_the_fused_step(monkeypatch):
    # The engine's own KV manager releases the sliding groups' blocks and forks n=3 samples
    # (copy-on-write of shared blocks); the same seeded tokens either way, and the decode
    # steps did run fused.
    from pagedgen import LLM, SamplingParams

    if native.gemm_kind() is None:  # dense bf16 weights fuse on our GEMMs only
        pytest.skip("no fused decode here (needs the native kernels and AMX, AVX-512 BF16 or AVX2)")
    prompts = [list(range(20, 25)), list(range(30, 67))]
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=24, seed=7,
                            ignore_eos=True)
    tokens, fused_results = {}, []
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDGEN_FUSED_DECODE", fused)
        llm = LLM(str(tiny_model_dir("gemma3")), threads=1, dtype="bfloat16", block_size=8,
                  num_blocks=200)
        if fused == "1":
            spy = _Spy(llm.runner.model.fused_decode)
            llm.runner.model.fused_decode = spy
            fused_results = spy.results
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[fused] = [[sample.token_ids for sample in out.outputs] for out in outputs]
        assert llm.engine.kv.counters.window_released > 0
    assert sum(r is not None for r in fused_results) >= 20
    assert tokens["1"] == tokens["0"]


def test_qwen3_qk_norm_is_not_fused():
    # Its q/k norm runs in torch on the layer path (Llama-style norm of strided heads): a
    # float32 sum order the C step does not reproduce, so Qwen3 keeps its layers.
    loaded = load_model(str(tiny_model_dir("qwen3")), dtype=torch.bfloat16, device="cpu")
    ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=8))
    assert loaded.model.fused_decode is None


def test_the_memory_report_counts_onednn_packed_weights(monkeypatch):
    """CPUs without our GEMM kernels keep projections in oneDNN's opaque packing, which has no
    storage to ask for its size: the weights report counts its elements instead of failing."""
    from pagedgen.model.runtime.weight_bytes import weight_bytes

    monkeypatch.setenv("PAGEDGEN_NATIVE_GEMM", "0")
    loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.bfloat16, device="cpu")
    model = loaded.model
    parameters = 2 * sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=8))
    held = weight_bytes(loaded.model)
    if model.layers[0].attention.qkv_packed is None:  # a torch build without oneDNN
        assert held.plain_bytes == parameters
        return
    # oneDNN's packing takes every row count: the plain projections give way to it, so the
    # packed copies are counted and the weights are held once.
    assert held.repacked_bytes > 0
    assert parameters <= held.total_bytes <= parameters + 2 * model.embed_weight.numel()
