"""The Triton path on a quantized pool, run by the interpreter on CPU (TRITON_INTERPRET=1):
attention reads 8-bit codes and scales and must match the float32 reference over the
dequantized blocks; through the model, the same logits as the torch path."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedgen.kernels import reference  # noqa: E402
from pagedgen.kernels.cpu import backend as cpu_backend

from pagedgen.kernels.triton import ops as triton_ops
from pagedgen.kernels.kv_quant import dequantize, kv_format  # noqa: E402
from paged_batch import make_paged_batch  # noqa: E402
from pagedgen.model.runtime.batch import ScheduledChunk  # noqa: E402
from pagedgen.model.runtime.runner import ModelRunner  # noqa: E402
from pagedgen.settings import EngineConfig
from tiny_models import tiny_loaded_model  # noqa: E402

SCALE = 0.3


def quantized_pool(batch, fmt_name: str):
    fmt = kv_format(fmt_name)
    num_blocks, block_size, heads, dim = batch.k_cache.shape
    k, v = (torch.zeros(batch.k_cache.shape, dtype=fmt.storage) for _ in range(2))
    ks, vs = torch.zeros(num_blocks, heads), torch.zeros(num_blocks, heads)
    triton_ops.store_kv(batch.k_cache.reshape(-1, heads, dim), batch.v_cache.reshape(-1, heads, dim),
                        k, v, torch.arange(num_blocks * block_size), k_scales=ks, v_scales=vs)
    return k, v, ks, vs


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_on_codes_matches_the_dequantized_reference(fmt_name, query_dtype):
    b = 8
    batch = make_paged_batch([1, b + 1, 3 * b - 1, b + 3, 2 * b + 5], [1, 1, 1, b + 3, 7],
                             num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=b, seed=5)
    k, v, ks, vs = quantized_pool(batch, fmt_name)
    query = batch.query.to(query_dtype)
    out = triton_ops.paged_attention(query, k, v, *batch.attention_args()[3:], SCALE,
                                     k_scales=ks, v_scales=vs)
    expected = reference.paged_attention(query.float(), dequantize(k, ks[:, None, :, None]),
                                         dequantize(v, vs[:, None, :, None]),
                                         *batch.attention_args()[3:], SCALE)
    atol = 1e-5 if query_dtype == torch.float32 else 2e-2
    assert out.dtype == query_dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


def test_triton_and_torch_paths_agree_through_the_model_on_an_int8_pool():
    loaded = tiny_loaded_model("qwen2")
    steps = [[ScheduledChunk(list(range(3, 22)), 0, [2, 0, 3], True), ScheduledChunk([5], 0, [1], True)],
             [ScheduledChunk([30], 19, [2, 0, 3], True), ScheduledChunk([6, 7, 8], 1, [1], True)]]
    logits = {}
    for ops in (cpu_backend, triton_ops):
        runner = ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=4, kv_cache_dtype="int8"), kernels=ops)
        logits[ops] = [runner.execute(chunks, [(1, 3)] if i else []) for i, chunks in enumerate(steps)]
        assert runner.kv_scales is not None and float(runner.kv_scales.abs().max()) > 0
    for expected, got in zip(logits[cpu_backend], logits[triton_ops]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
