"""Broken and hostile model files: every load failure is one ModelLoadError naming the file
and the reason (no MemoryError, no raw struct/json/safetensors error); a tokenizer folder's
custom code never runs and nothing is read from stdin; a GGUF file keeps its own tokenizer."""
from __future__ import annotations

import ast
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hostile_models as hm
from pagedgen.cli.app import app
from pagedgen.model.errors import ModelLoadError
from pagedgen.model.loading.loader import load_model
from tiny_models import tiny_model_dir, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TEXT = "def hello(world):\n    return 42 <|im_end|>"


def expect_load_error(model: Path, file_name: str, reason: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as caught:
        load_model(str(model), dtype="float32")
    message = str(caught.value)
    assert file_name in message and reason in message, message
    return caught.value


# --- HF folders: weights --------------------------------------------------------------------

def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


WEIGHT_DAMAGE = {
    "truncated download": (_truncate, "model.safetensors"),
    "garbage bytes": (lambda p: p.write_bytes(os.urandom(4096)), "model.safetensors"),
    "empty file": (lambda p: p.write_bytes(b""), "model.safetensors"),
    "header length 2^62": (lambda p: p.write_bytes(struct.pack("<Q", 1 << 62) + b"{}"), "model.safetensors"),
    "header not json": (lambda p: p.write_bytes(struct.pack("<Q", 8) + b"{{{{{{{{"), "model.safetensors"),
}


@pytest.mark.parametrize("case", list(WEIGHT_DAMAGE))
def test_damaged_safetensors_is_one_named_error(tmp_path, case):
    damage, name = WEIGHT_DAMAGE[case]
    folder = hm.copy_model_folder(tmp_path / "m")
    damage(folder / name)
    error = expect_load_error(folder, name, "")
    assert error.path == folder / name and error.reason


def test_shard_index_naming_files_outside_the_folder_is_refused(tmp_path):
    folder = hm.copy_model_folder(tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}))
    expect_load_error(folder, "model.safetensors.index.json", "shard files of this folder")


# --- HF folders: config.json ------------------------------------------------------------------

def _config_edit(**changes):
    def edit(raw):
        raw.update(changes)
        return raw
    return edit


CONFIG_DAMAGE = {
    "a list": (lambda raw: [raw], "must hold a JSON object, not a list"),
    "a string": (lambda raw: "config", "must hold a JSON object, not a str"),
    "vocab_size 10^12": (_config_edit(vocab_size=10**12), "vocab_size=1000000000000 is beyond any real model"),
    "hidden_size 10^9": (_config_edit(hidden_size=10**9), "hidden_size=1000000000 is beyond"),
    "max positions 10^15": (_config_edit(max_position_embeddings=10**15), "max_position_embeddings"),
    "negative layers": (_config_edit(num_hidden_layers=-1), "num_layers must be a positive integer"),
    "zero heads": (_config_edit(num_attention_heads=0), "num_heads must be a positive integer"),
    "vocab a string": (_config_edit(vocab_size="50000"), "vocab_size must be a positive integer"),
    "vocab a float": (_config_edit(vocab_size=512.0), "vocab_size must be a positive integer"),
    "eps a list": (_config_edit(rms_norm_eps=[1]), "TypeError"),
    "theta NaN": (_config_edit(rope_parameters={"rope_type": "default", "rope_theta": math.nan}), "rope_theta must be a positive finite number"),
    "rope params a list": (_config_edit(rope_parameters=[1, 2]), ""),
    # Within every field's bound, but 4M x 64 weights cannot come from a 300 kB file:
    # refused before the decoder is allocated.
    "vocab beyond the weights": (_config_edit(vocab_size=4_000_000), "does not belong to these weights"),
}


@pytest.mark.parametrize("case", list(CONFIG_DAMAGE))
def test_absurd_config_is_one_named_error(tmp_path, case):
    edit, reason = CONFIG_DAMAGE[case]
    folder = hm.copy_model_folder(tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(raw)))
    expect_load_error(folder, "config.json", reason)
    if case == "vocab beyond the weights":
        return   # sizing reads no weights: nothing to compare with there, and nothing allocated
    # inspect-memory reads the same config: exit 2 with the same message, no traceback.
    result = CliRunner().invoke(app, ["inspect-memory", "--model", str(folder), "--kv-memory", "1MiB"])
    assert result.exit_code == 2 and "config.json" in result.output, result.output
    assert "Traceback" not in result.output


def test_generation_config_that_is_a_list(tmp_path):
    folder = hm.copy_model_folder(tmp_path / "m")
    (folder / "generation_config.json").write_text("[1, 2]")
    expect_load_error(folder, "generation_config.json", "must hold a JSON object, not a list")


def test_config_that_is_not_json_or_nested_too_deep(tmp_path):
    folder = hm.copy_model_folder(tmp_path / "m")
    (folder / "config.json").write_text('{"vocab_size": 5')
    expect_load_error(folder, "config.json", "")
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    expect_load_error(folder, "config.json", "")


# --- GGUF headers made by hand --------------------------------------------------------------

EMBED = hm.tensor_info("token_embd.weight", (64, 512))   # ggml order: [hidden, vocab]
GGUF_DAMAGE = {
    "alignment 0": (hm.gguf_header([hm.kv_uint32("general.alignment", 0)], [EMBED]),
                    "general.alignment must be a positive power of two, got 0"),
    "alignment 3": (hm.gguf_header([hm.kv_uint32("general.alignment", 3)], [EMBED]),
                    "power of two, got 3"),
    "arrays nested 100,000 deep": (hm.gguf_header([hm.kv_nested_arrays("x", 100_000)], []),
                                   "nested more than"),
    "0-dim tensor": (hm.gguf_header([], [hm.tensor_info("token_embd.weight", ())]), "has 0 dimensions"),
    "5-dim tensor": (hm.gguf_header([], [hm.tensor_info("t", (1, 1, 1, 1, 1))]), "has 5 dimensions"),
    "empty dimension": (hm.gguf_header([], [hm.tensor_info("t", (32, 0))]), "empty dimension"),
    "unknown ggml type": (hm.gguf_header([], [hm.tensor_info("t", (32,), ggml_type=999)]),
                          "unknown ggml type 999"),
    "tensor past the end": (hm.gguf_header([], [hm.tensor_info("t", (1 << 20, 1 << 20))]),
                            "past the end of the file"),
    "2^60 metadata entries": (hm.gguf_header([], [], kv_count=1 << 60), "metadata entries"),
    "2^40 tensors": (hm.gguf_header([], [], tensor_count=1 << 40), "tensors"),
    "string of 2^60 bytes": (hm.gguf_header([struct.pack("<Q", 1 << 60)], []), "string bytes"),
    "array of 2^60 ints": (hm.gguf_header([hm._string("x") + struct.pack("<IIQ", 9, 4, 1 << 60)], []),
                           "array elements"),
    "version 99": (hm.gguf_header([], [], version=99), "GGUF version 99"),
    "cut inside the header": (hm.gguf_header([hm.kv_string("general.architecture", "llama")], [])[:30],
                              "cannot read GGUF file"),
    "not utf-8 key": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2) + b"\xff\xfe", "utf-8"),
}


@pytest.mark.parametrize("case", list(GGUF_DAMAGE))
def test_hand_made_gguf_header_is_one_named_error(tmp_path, case):
    data, reason = GGUF_DAMAGE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data + bytes(64))   # padding: the errors must not come from a short read
    if case == "cut inside the header":
        path.write_bytes(data)
    expect_load_error(path, "bad.gguf", reason)


def test_truncated_real_gguf_is_one_named_error(tmp_path):
    path = hm.tiny_gguf_with_tokenizer(tmp_path / "tiny.gguf")
    _truncate(path)
    expect_load_error(path, "tiny.gguf", "past the end of the file")


def test_gguf_without_an_embedded_tokenizer(tmp_path):
    path = hm.tiny_gguf_with_tokenizer(tmp_path / "bare.gguf", embed_tokenizer=False)
    expect_load_error(path, "bare.gguf", "cannot build a tokenizer from the GGUF file")


def test_gguf_whose_metadata_claims_a_huge_model(tmp_path):
    """Header dimensions beyond what the file's bytes can hold: refused before allocating."""
    path = hm.tiny_gguf_with_tokenizer(tmp_path / "tiny.gguf")
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4          # after the key and its value type
    data[at:at + 4] = struct.pack("<I", 200_000)
    path.write_bytes(bytes(data))
    expect_load_error(path, "tiny.gguf", "does not belong to these weights")


# --- tokenizers: no remote code, no prompt --------------------------------------------------

def _auto_map_folder(tmp_path: Path, tokenizer_class: str | None) -> tuple[Path, Path]:
    """A model folder whose tokenizer_config.json points transformers at the folder's own
    tokenization_evil.py, which would write a marker file if it were ever imported."""
    tmp_path.mkdir()
    folder = hm.copy_model_folder(tmp_path / "remote-code")
    marker = tmp_path / "CODE_RAN"
    (folder / "tokenization_evil.py").write_text(textwrap.dedent(f"""
        open({str(marker)!r}, "w").write("the folder's code ran")
        from transformers import PreTrainedTokenizerFast
        class EvilTokenizer(PreTrainedTokenizerFast):
            pass
    """))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer"] * 2}
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, marker


LOAD_WITH_STDIN_CLOSED = """
import os, sys
os.close(0)                      # nothing to read a [y/N] answer from
from pagedgen.model.loading.loader import load_model
from pagedgen.model.errors import ModelLoadError
text, folders = sys.argv[1], sys.argv[2:]
for folder in folders:
    try:
        loaded = load_model(folder, dtype="float32")
    except ModelLoadError as error:
        print("REFUSED", error)
    else:
        print("LOADED", loaded.tokenizer.encode(text))
"""


def test_auto_map_tokenizer_code_never_runs_and_nothing_is_asked(tmp_path):
    """Two folders: one naming only the custom class (refused, named), one that also has the
    plain tokenizer.json to fall back on (loaded). One process with stdin closed: no hang."""
    custom_only, marker_a = _auto_map_folder(tmp_path / "a", "EvilTokenizer")
    with_plain, marker_b = _auto_map_folder(tmp_path / "b", None)
    result = subprocess.run([sys.executable, "-c", LOAD_WITH_STDIN_CLOSED, SAMPLE_TEXT,
                             str(custom_only), str(with_plain)],
                            capture_output=True, text=True, timeout=180, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert not marker_a.exists() and not marker_b.exists()
    refused, loaded = result.stdout.strip().splitlines()   # one line each
    assert refused.startswith("REFUSED") and str(custom_only) in refused
    assert "custom tokenizer code is never run" in refused
    assert loaded == f"LOADED {tiny_tokenizer().encode(SAMPLE_TEXT)}"
    assert "[y/N]" not in result.stdout + result.stderr
    assert "trust_remote_code=True" not in refused   # never advise running the code


def test_every_transformers_load_call_refuses_remote_code():
    """Static: each from_pretrained / AutoX call in the package passes trust_remote_code=False."""
    calls = []
    for path in (REPO / "pagedgen").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("from_pretrained", "from_config"):
                keywords = {k.arg: k.value for k in node.keywords}
                value = keywords.get("trust_remote_code")
                calls.append((path.name, node.lineno, isinstance(value, ast.Constant) and value.value is False))
    assert calls and all(ok for *_, ok in calls), calls


# --- GGUF: its own tokenizer --------------------------------------------------------------------

def _other_tokenizer_folder(folder: Path) -> Path:
    """A valid tokenizer of another vocabulary (word-level, 5 tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "def": 1, "hello": 2, "return": 3, "42": 4},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)
    return folder


def test_stray_tokenizer_next_to_a_gguf_is_ignored(tmp_path):
    path = hm.tiny_gguf_with_tokenizer(tmp_path / "tiny.gguf")
    _other_tokenizer_folder(tmp_path)     # tokenizer.json + tokenizer_config.json beside the file
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = load_model(str(path), dtype="float32")
    assert len(loaded.tokenizer) == 512
    assert loaded.tokenizer.encode(SAMPLE_TEXT) == tiny_tokenizer().encode(SAMPLE_TEXT)


def test_explicit_tokenizer_for_a_gguf_must_match_its_vocabulary(tmp_path):
    path = hm.tiny_gguf_with_tokenizer(tmp_path / "tiny.gguf")
    other = _other_tokenizer_folder(tmp_path / "other")
    with pytest.raises(ModelLoadError, match=r"tiny.gguf.*does not match the vocabulary embedded "
                                             r"in the GGUF file \(512 tokens; first differing id: 0\)"):
        load_model(str(path), dtype="float32", tokenizer=other)
    same = load_model(str(path), dtype="float32", tokenizer=tiny_model_dir("llama"))
    assert same.tokenizer.name_or_path == str(tiny_model_dir("llama"))
