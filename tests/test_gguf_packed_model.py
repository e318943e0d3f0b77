"""A GGUF model whose matrices stay packed (weights="packed") against the same file
dequantized at load (weights="dequantized"): same blocks, so they differ only by the
activation rounding of the int8 kernels. Tiny random models, written at test time."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

from hostile_models import _embed_tokenizer, write_llama_header
from pagedgen import LLM, SamplingParams
from pagedgen.kernels.cpu import gguf as gguf_kernels
from pagedgen.settings import EngineConfig
from pagedgen.model.layers import quantized_linear as ql
from pagedgen.model.layers.quantized_linear import QuantizedWeight
from pagedgen.model.loading.loader import load_model
from pagedgen.model.runtime.batch import ScheduledChunk
from pagedgen.model.runtime.runner import ModelRunner
from test_gguf_gemm import tiles_in_form
from tiny_models import gguf_name, hf_config, tiny_hf_model, tiny_model_dir, tiny_tokenizer

# One type per kind of tensor, so that every type the real files hold runs inside a model.
TYPES = {"q_proj": T.Q4_1, "k_proj": T.Q4_1, "v_proj": T.Q5_0, "o_proj": T.Q8_0,
         "gate_proj": T.Q4_0, "up_proj": T.Q4_1, "down_proj": T.Q5_0,
         "embed_tokens": T.Q8_0, "lm_head": T.Q8_0}


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (the loader must undo it)."""
    shape = weights.shape
    return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_quantized_gguf(path, tied: bool = False):
    config, model = hf_config("llama", tied), tiny_hf_model("llama", tied)
    writer = GGUFWriter(path, "llama")
    write_llama_header(writer, config)
    _embed_tokenizer(writer, tiny_tokenizer())
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.numpy()
        if "q_proj" in name or "k_proj" in name:
            data = permute(data, config.num_attention_heads if "q_proj" in name
                           else config.num_key_value_heads)
        kind = next((t for key, t in TYPES.items() if key in name), None)
        if kind is None or data.ndim != 2:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
        else:
            writer.add_tensor(gguf_name(name), quantize(np.ascontiguousarray(data), kind),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def last_logits(loaded, prompt=(5, 9, 13, 40, 41, 7)) -> torch.Tensor:
    runner = ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=2))
    return runner.execute([ScheduledChunk(list(prompt), 0, [1], True)], [])[0]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_model_matches_the_dequantized_one(tmp_path, tied, dtype):
    path = write_quantized_gguf(tmp_path / "q.gguf", tied)
    packed = load_model(path, dtype=dtype, weights="packed")
    dense = load_model(path, dtype=dtype, weights="dequantized")
    assert packed.model.gguf_packed is not None and dense.model.gguf_packed is None
    got, want = last_logits(packed), last_logits(dense)
    # int8 activations (relative step 1/254 per block) through 2 layers, plus bf16 rounding
    tolerance = 0.03 if dtype == "float32" else 0.06
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    assert got.argmax() == want.argmax()


def test_packed_weights_are_views_of_the_mapped_file(tmp_path):
    path = write_quantized_gguf(tmp_path / "q.gguf", tied=True)
    decoder = load_model(path, dtype="bfloat16", weights="packed").model
    runner_free = decoder.layers[0]
    decoder.pack_weights()
    for layer in decoder.layers:
        for weight in (layer.attention.qkv_packed, layer.attention.o_packed,
                       layer.mlp.gate_up_packed, layer.mlp.down_packed):
            assert isinstance(weight, QuantizedWeight)
            for part in weight.parts:
                base = part.blocks
                while base.base is not None and not isinstance(base, np.memmap):
                    base = base.base
                assert isinstance(base, np.memmap)  # the file's pages, not a copy
    assert decoder.lm_head_packed is decoder.embed_packed  # tied: the table is the head
    assert decoder.embed_weight.numel() == 0 and runner_free.attention.qkv_weight.numel() == 0
    # the fused decode step (where the native kernels are) reads the same mapped blocks
    fused = decoder.fused_decode
    assert fused is None or (fused.gemm_kind == "gguf" and fused.gguf.projections[0].parts[0]
                             .blocks == decoder.layers[0].attention.qkv_packed.parts[0]
                             .blocks.ctypes.data)
    assert decoder.gguf_packed.stored_bytes > 0


def test_batch_invariant_rows_do_not_depend_on_the_batch(tmp_path):
    """In batch-invariant mode a row's result is the same alone or among many rows, also past
    the row count where the normal mode switches to dequantize-and-GEMM."""
    path = write_quantized_gguf(tmp_path / "q.gguf")
    decoder = load_model(path, dtype="bfloat16", weights="packed").model
    decoder.pack_weights(batch_invariant=True)
    weight = decoder.layers[0].mlp.gate_up_packed
    rows = torch.randn(ql.dequantize_min_rows(weight.library) + 5,
                       weight.in_features).to(torch.bfloat16)
    many = ql.quantized_linear(rows, weight)
    for index in (0, 3, rows.shape[0] - 1):
        assert torch.equal(ql.quantized_linear(rows[index:index + 1], weight)[0], many[index])


@pytest.mark.parametrize("form", [0, 1], ids=["vdpbf16ps", "float32-fma"])
def test_large_row_counts_dequantize_and_agree(tmp_path, form):
    """Past the dequantize crossover (in each form of the bf16 tiles, where the library has
    them: the float32 form's lies at the dense GEMM's row limit) rows agree with small calls."""
    path = write_quantized_gguf(tmp_path / "q.gguf")
    decoder = load_model(path, dtype="bfloat16", weights="packed").model
    decoder.pack_weights()
    weight = decoder.layers[1].attention.qkv_packed
    with tiles_in_form(weight.library, form):
        rows = torch.randn(ql.dequantize_min_rows(weight.library) + 1,
                           weight.in_features).to(torch.bfloat16)
        big = ql.quantized_linear(rows, weight).float()
        small = torch.cat([ql.quantized_linear(rows[i:i + 8], weight) for i in
                           range(0, rows.shape[0], 8)]).float()
    assert (big - small).abs().max() <= 0.05 * big.abs().max()


@pytest.mark.parametrize("bf16_hardware", [True, False])
def test_large_row_counts_multiply_in_float32_where_bf16_is_not_in_hardware(
        tmp_path, monkeypatch, bf16_hardware):
    """Past the dequantize crossover a float32 run multiplies in float32, and so does a bf16
    run on a CPU without bf16 hardware (its bf16 GEMM would be emulated, several times
    slower): the weight dequantized to float32, the bf16 rows widened exactly."""
    monkeypatch.setattr(ql, "cpu_has_bf16_arithmetic", lambda: bf16_hardware)
    path = write_quantized_gguf(tmp_path / "q.gguf")
    decoder = load_model(path, dtype="bfloat16", weights="packed").model
    decoder.pack_weights()
    weight = decoder.layers[1].mlp.down_packed
    rows = torch.randn(ql.dequantize_min_rows(weight.library) + 3, weight.in_features,
                       generator=torch.Generator().manual_seed(2))
    exact = ql.dequantized(weight, torch.float32)
    assert torch.equal(ql.quantized_linear(rows, weight), torch.nn.functional.linear(rows, exact))
    got = ql.quantized_linear(rows.to(torch.bfloat16), weight)
    assert got.dtype == torch.bfloat16
    if not bf16_hardware:
        want = torch.nn.functional.linear(rows.to(torch.bfloat16).float(), exact)
        assert torch.equal(got, want.to(torch.bfloat16))


def test_middle_row_counts_compute_the_dequantized_bf16_product(tmp_path):
    """Where the library has bf16 tiles, bf16 rows between tiles_min_rows() and the
    dequantize crossover get the dequantized bf16 path's product (float32 summation order
    aside), each part of a stacked projection in its own columns."""
    path = write_quantized_gguf(tmp_path / "q.gguf")
    decoder = load_model(path, dtype="bfloat16", weights="packed").model
    decoder.pack_weights()
    weight = decoder.layers[1].attention.qkv_packed
    if not gguf_kernels.has_bf16_tiles(weight.library):
        pytest.skip(f"the {weight.library.path} library has no bf16 tiles")
    tiles_from = ql.tiles_min_rows(weight.library, (part.tensor_type for part in weight.parts))
    rows = torch.randn(tiles_from + 3, weight.in_features).to(torch.bfloat16)
    got = ql.quantized_linear(rows, weight, out_dtype=torch.float32).double()
    dense = ql.dequantized(weight, torch.bfloat16).double()
    want = rows.double() @ dense.T
    bound = (weight.in_features / 16 + 4) * 2.0 ** -23 * (rows.double().abs() @ dense.abs().T)
    assert ((got - want).abs() <= bound).all()
    below = rows[:tiles_from - 1]
    int8 = ql.quantized_linear(below, weight, out_dtype=torch.float32).double()
    assert not ((int8 - below.double() @ dense.T).abs() <= bound[:below.shape[0]]).all()


def test_the_packed_lm_head_gives_the_bf16_logits_widened(tmp_path):
    """The sampler's float32 logits from a packed LM head are its bf16 result widened, as
    from a dense one, at every row count (int8 kernel, tiles, panels), rounded in the kernel."""
    from pagedgen.model.layers.linear import linear_float32
    decoder = load_model(write_quantized_gguf(tmp_path / "q.gguf"), dtype="bfloat16",
                         weights="packed").model
    decoder.pack_weights()
    head = decoder.lm_head_packed
    assert isinstance(head, QuantizedWeight)
    for rows in (1, 9, 20, 40):
        x = torch.randn(rows, head.in_features).to(torch.bfloat16)
        logits = linear_float32(x, decoder.lm_head_weight, head)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, ql.quantized_linear(x, head).float()), rows


def test_packed_generation_runs_and_weights_are_checked(tmp_path, monkeypatch):
    from pagedgen.model.loading import loader
    path = write_quantized_gguf(tmp_path / "q.gguf")
    # auto packs only when the dequantized copy would crowd memory: pretend memory is short.
    monkeypatch.setattr(loader, "_available_memory", lambda: 1024)
    outputs = [LLM(str(path), weights=w, dtype="float32", kv_memory=1 << 20, threads=1).generate(
        [[5, 9, 13]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids for w in ("auto", "packed")]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(path, weights="int4")
    with pytest.raises(ValueError, match="needs a GGUF file"):
        load_model(str(tiny_model_dir("llama")), weights="packed")


def test_without_a_compiler_gguf_weights_are_dequantized_with_one_warning(tmp_path, monkeypatch):
    from pagedgen.kernels.cpu.gguf import build
    path = write_quantized_gguf(tmp_path / "q.gguf")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("PAGEDGEN_GGUF_PATH", raising=False)
    build.load_path.cache_clear()
    build.best.cache_clear()
    try:
        with pytest.warns(UserWarning, match="packed GGUF kernels unavailable") as caught:
            loaded = load_model(path, dtype="float32", weights="packed")
            load_model(path, dtype="float32", weights="packed")
        assert len(caught) == 1 and loaded.model.gguf_packed is None
    finally:
        build.load_path.cache_clear()
        build.best.cache_clear()


def test_auto_packs_in_bfloat16_and_in_float32_only_when_memory_is_short(tmp_path, monkeypatch):
    """bf16 on a CPU whose kernels decode in registers: packed (the faster and smaller path);
    float32 (the oracle's dtype) or the portable kernels: packed only when the dequantized copy
    would crowd memory; never on another device."""
    from pagedgen.model.loading import gguf_packed, loader
    path = write_quantized_gguf(tmp_path / "q.gguf")
    monkeypatch.setattr(loader, "_available_memory", lambda: 1 << 40)
    fast = gguf_packed.fast_packed_kernels()
    assert (load_model(path, dtype="bfloat16", weights="auto").model.gguf_packed is not None) == fast
    assert load_model(path, dtype="float32", weights="auto").model.gguf_packed is None
    monkeypatch.setattr(gguf_packed, "fast_packed_kernels", lambda: False)
    assert load_model(path, dtype="bfloat16", weights="auto").model.gguf_packed is None
    monkeypatch.setattr(loader, "_available_memory", lambda: 1024)
    assert load_model(path, dtype="float32", weights="auto").model.gguf_packed is not None
    assert loader._resolve_auto("auto", None, torch.bfloat16, torch.device("cuda")) == "dequantized"


def test_the_memory_report_shows_the_weight_bytes_as_held(tmp_path):
    """Packed: the file's quantized blocks (as many bytes as the file's quantized tensors) and
    small plain tensors; dequantized bf16: two bytes per parameter, plus the GEMM kernels'
    repacked copies where the CPU has our kernels."""
    from pagedgen.model.loading.gguf_file import read_gguf

    path = write_quantized_gguf(tmp_path / "q.gguf")
    quantized = sum(t.data.nbytes for t in read_gguf(path).tensors if t.data.ndim == 2
                    and t.data.dtype == np.uint8)
    sections = {}
    for weights in ("packed", "dequantized"):
        llm = LLM(str(path), weights=weights, dtype="bfloat16", kv_memory=1 << 20, threads=1)
        sections[weights] = llm.memory_report()["weights"]
        if weights == "dequantized":
            parameters = sum(p.numel() for p in llm.runner.model.parameters())
    packed, dense = sections["packed"], sections["dequantized"]
    assert packed["held_as"] == "packed" and dense["held_as"] == "dense"
    assert packed["gguf_block_bytes"] == quantized and packed["repacked_bytes"] == 0
    assert packed["plain_bytes"] < quantized                 # norms only
    assert dense["gguf_block_bytes"] == 0 and dense["plain_bytes"] >= 2 * parameters
    assert dense["total_bytes"] == dense["plain_bytes"] + dense["repacked_bytes"]
    assert packed["total_bytes"] < dense["total_bytes"]


def test_the_pool_is_sized_after_the_weights_and_sets_the_mapped_blocks_aside(tmp_path, monkeypatch):
    """Free memory does not show a mapped file's blocks until the first steps touch them: a
    share of free memory is taken after setting them aside, and a pool that fits only if they
    never page in is refused, naming them. Dense weights' repacked copies are made before free
    memory is read, so free memory already shows them."""
    from pagedgen.model.runtime import kv_cache as kv

    path = write_quantized_gguf(tmp_path / "q.gguf")
    loaded = load_model(path, dtype="float32", weights="packed")
    mapped = loaded.model.gguf_packed.stored_bytes
    per_block = 8 * loaded.config.kv_bytes_per_token(torch.float32)
    monkeypatch.setattr(kv, "available_memory_bytes", lambda device: mapped + per_block * 100)
    runner = ModelRunner(loaded, EngineConfig(block_size=8), kv_memory_fraction=0.5)
    assert mapped > 0 and runner.num_blocks == 50
    with pytest.raises(ValueError, match=f"less {mapped} bytes of mapped weights not resident "
                                         "yet; the largest pool that fits is 100 blocks"):
        ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=101))

    seen_packing = []  # the LM head's packing when free memory is read (None: not made yet)
    dense = load_model(path, dtype="bfloat16", weights="dequantized")
    per_block = 8 * dense.config.kv_bytes_per_token(torch.bfloat16)
    monkeypatch.setattr(kv, "available_memory_bytes", lambda device: seen_packing.append(
        dense.model.lm_head_packed) or per_block * 100)
    assert ModelRunner(dense, EngineConfig(block_size=8), kv_memory_fraction=0.5).num_blocks == 50
    assert seen_packing == [dense.model.lm_head_packed]  # None only where the CPU packs nothing
