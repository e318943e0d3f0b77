"""Gemma 3 loading: config.json spellings (transformers 4.x and 5.x, the multimodal folders'
nested text_config), multimodal checkpoints' tensor names, and gemma3 GGUF files as llama.cpp
writes them (norm weights stored as 1 + w, its own tensor names). transformers' config
classes are the oracle for what a config means."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file

from pagedgen.model.config import UnsupportedModelError
from pagedgen.model.loading.gguf_file import read_gguf
from pagedgen.model.loading.gguf_loader import gguf_model_config, iter_gguf_tensors
from pagedgen.model.loading.hf_config import model_config_from_hf
from pagedgen.model.loading.loader import build_decoder, load_model
from test_model_parity import pagedgen_greedy, random_prompts
from tiny_models import hf_config, tiny_hf_model, tiny_loaded_model, tiny_model_dir, unpacked_tiny_model

# A Gemma 3 4B-like text config as transformers 4.x wrote it: global RoPE scaled, local base
# apart, the layer pattern as an integer.
GEMMA_4X = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300,
                hidden_size=64, intermediate_size=128, num_hidden_layers=13, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=48, rms_norm_eps=1e-6,
                rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=24,
                sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=4096)


def test_gemma_4x_config_means_what_transformers_makes_of_it():
    from transformers import Gemma3TextConfig

    ours = model_config_from_hf(dict(GEMMA_4X))
    theirs = Gemma3TextConfig(**{k: v for k, v in GEMMA_4X.items() if k != "architectures"})
    expected_windows = [24 if kind == "sliding_attention" else 0 for kind in theirs.layer_types]
    assert [ours.window_of(i) for i in range(13)] == expected_windows
    assert ours.layer_types == tuple(theirs.layer_types)
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    global_layer, local_layer = expected_windows.index(0), 0
    assert ours.rope_of(global_layer) == (full["rope_theta"], {"rope_type": "linear", "factor": 8.0})
    assert ours.rope_of(local_layer) == (local["rope_theta"], None)
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    assert ours.hidden_act == "gelu_pytorch_tanh" and ours.qk_norm and ours.tie_word_embeddings
    assert ours.max_position_embeddings == 4096  # no cap at the window


def test_gemma_defaults_fill_a_sparse_text_config():
    """Multimodal folders list only what differs from Gemma3TextConfig's defaults."""
    from transformers import Gemma3TextConfig

    sparse = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
              "sliding_window": 1024, "model_type": "gemma3_text",
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": sparse, "vision_config": {"hidden_size": 1152}}
    ours, theirs = model_config_from_hf(raw), Gemma3TextConfig(**sparse)
    assert ours.architecture == "Gemma3ForCausalLM"
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5


@pytest.mark.parametrize("change,message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_act='gelu'"),
    ({"layer_types": ["sliding_attention"] * 12}, "layer_types has 12 entries for 13 layers"),
    ({"layer_types": ["chunked_attention"] * 13}, "chunked_attention"),
    ({"sliding_window": -4}, "sliding_window must be a positive integer"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unsupported_gemma_configs_are_named(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_hf({**GEMMA_4X, **change})


def test_multimodal_folder_runs_its_text_decoder(tmp_path):
    """A Gemma3ForConditionalGeneration folder (text_config nested, the decoder's tensors under
    model.language_model., a vision tower beside it) runs like the text-only model."""
    text_folder = tiny_model_dir("gemma3")
    folder = tmp_path / "multimodal"
    shutil.copytree(text_folder, folder)
    text = json.loads((text_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": {"hidden_size": 8}}))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(text_folder / "model.safetensors").items()}
    tensors["model.vision_tower.patch_embedding.weight"] = torch.zeros(8, 3)
    tensors["model.multi_modal_projector.norm.weight"] = torch.zeros(8)
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors")
    loaded, expected = load_model(str(folder), dtype="float32"), tiny_loaded_model("gemma3")
    assert loaded.config == expected.config
    prompts = random_prompts([40], loaded.config.vocab_size, seed=2)
    assert pagedgen_greedy(loaded, prompts, 12, 8) == pagedgen_greedy(expected, prompts, 12, 8)


# --- gemma3 GGUF files ---------------------------------------------------------------------

# llama.cpp's names for Gemma 3's layer tensors (its converter's tensor map).
GEMMA3_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_proj": "attn_q",
                     "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                     "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gemma_gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GEMMA3_GGUF_NAMES[module]}.{kind}"


def write_tiny_gemma_gguf(path) -> None:
    """What llama.cpp's converter writes for tiny_hf_model("gemma3"): gemma3.* keys, every
    norm weight stored as 1 + w, no lm_head (tied)."""
    config, model = hf_config("gemma3"), tiny_hf_model("gemma3")
    writer = GGUFWriter(path, "gemma3")
    for key, value in (("block_count", config.num_hidden_layers), ("context_length", 512),
                       ("embedding_length", config.hidden_size),
                       ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_attention_heads),
                       ("attention.head_count_kv", config.num_key_value_heads),
                       ("attention.key_length", config.head_dim),
                       ("attention.value_length", config.head_dim),
                       ("attention.sliding_window", config.sliding_window)):
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.rope.freq_base", config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = tensor.numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        writer.add_tensor(_gemma_gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gemma_gguf_loads_like_its_safetensors_twin(tmp_path):
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma_gguf(path)
    reader = read_gguf(path)
    config = gguf_model_config(reader)
    expected = unpacked_tiny_model("gemma3")
    assert config.layer_types == expected.config.layer_types
    assert config.sliding_window == expected.config.sliding_window
    assert [config.rope_of(i) for i in range(8)] == [expected.config.rope_of(i) for i in range(8)]
    assert config.attention_scale == expected.config.attention_scale
    decoder = build_decoder(config, iter_gguf_tensors(reader, config), torch.float32,
                            torch.device("cpu"))
    for (name, got), want in zip(decoder.state_dict().items(), expected.model.state_dict().values()):
        # (1 + w) - 1 in float32 loses w's last bits, exactly as in transformers' GGUF loader.
        tolerance = 1e-6 if "norm" in name else 0
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0, msg=name)
    twin = type(expected)(model=decoder, tokenizer=expected.tokenizer, config=config,
                          name="gguf", eos_token_ids=expected.eos_token_ids)
    prompts = random_prompts([5, 40], config.vocab_size, seed=9)
    assert pagedgen_greedy(twin, prompts, 16, 8) == pagedgen_greedy(expected, prompts, 16, 8)
