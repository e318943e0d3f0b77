"""The one-call decode step (kernels/cpu/decode_step.c via pagedgen/model/layers/fused_decode.py) gives
bit-identical logits and KV cache (8-bit pools: codes and scales) to running the layers one
module at a time, and steps it does not cover (prefill chunks) still run the layers."""
from __future__ import annotations

import pytest
import torch

from pagedgen.kernels.cpu import native

from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.runner import ModelRunner, ScheduledChunk
from pagedgen.settings import EngineConfig
from tiny_models import sequential_block_tables, tiny_model_dir

BLOCK_SIZE = 8
PROMPT_LENGTHS = [1, 7, 8, 20]  # a lone token, block size -1, +0, several blocks


def _runner(model_path: str | None, kv_cache_dtype: str = "auto") -> ModelRunner:
    loaded = load_model(model_path, dtype=torch.bfloat16, device="cpu")  # private: we toggle it
    runner = ModelRunner(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=64, kv_cache_dtype=kv_cache_dtype))
    if runner.model.fused_decode is None:
        pytest.skip("no fused decode here (needs the native kernels and AMX or AVX-512 BF16)")
    assert runner.model.fused_decode.gemm_kind == native.gemm_kind()
    return runner


class _Spy:
    """Stands in for the model's FusedDecode and records what each call returned."""

    def __init__(self, fused):
        self.fused, self.results = fused, []

    def run(self, *args):
        self.results.append(self.fused.run(*args))
        return self.results[-1]


def _generate(runner: ModelRunner, fused: bool, steps: int = 5):
    """Prefill, then greedy decode steps: every step's logits, the final cache, the spy."""
    saved = runner.model.fused_decode
    spy = _Spy(saved)
    runner.model.fused_decode = spy if fused else None
    runner.kv_cache.view(torch.uint8).zero_()
    if runner.kv_scales is not None:
        runner.kv_scales.zero_()
    lengths = list(PROMPT_LENGTHS)
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


def _assert_fused_equals_layers(runner):
    """The same greedy run fused and layer by layer: the prefill step not covered (None), every
    decode step covered, logits and K/V (an 8-bit pool's scales too) bit-identical. Returns
    the fused run's logits and cache."""
    fused_logits, fused_cache, spy = _generate(runner, fused=True)
    layer_logits, layer_cache, _ = _generate(runner, fused=False)
    assert [r is not None for r in spy.results] == [False] + [True] * (len(fused_logits) - 1)
    for fused, layered in zip(fused_logits, layer_logits):
        assert torch.equal(fused, layered)
    assert torch.equal(fused_cache[0], layer_cache[0])
    if fused_cache[1] is not None:
        assert torch.equal(fused_cache[1], layer_cache[1])
    return fused_logits, fused_cache


@pytest.mark.parametrize("model, kv_cache_dtype", [
    ("tiny", "auto"), ("default", "auto"),
    ("tiny", "int8"), ("tiny", "fp8_e4m3"), ("tiny", "fp8_e5m2"), ("default", "int8")])
def test_fused_decode_is_bit_identical_to_the_layers(model, kv_cache_dtype):
    # tiny: head_dim 16 (the portable attention loop); default: SmolLM2, head_dim 64 (AVX-512).
    # 8-bit pools: the codes and their scales (re-quantized as blocks fill) must match too.
    runner = _runner(str(tiny_model_dir("llama")) if model == "tiny" else None, kv_cache_dtype)
    _assert_fused_equals_layers(runner)


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
        pytest.skip("no fused decode here (needs the native kernels and AMX or AVX-512 BF16)")
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
    fused_logits, fused_cache, spy = _generate(runner, fused=True)
    layer_logits, layer_cache, _ = _generate(runner, fused=False)
    assert [r is not None for r in spy.results] == [False] + [True] * (len(fused_logits) - 1)
    for fused, layered in zip(fused_logits, layer_logits):
        assert torch.equal(fused, layered)
    assert torch.equal(fused_cache[0], layer_cache[0])
