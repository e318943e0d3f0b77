"""Config: YAML + overrides, validation messages naming file and key, the shipped configs."""

from pathlib import Path

import pytest

from pagedgen.jobs.config import (ConfigError, RunConfig, load_config, parse_set_option, parse_size,
                             read_yaml)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    config = load_config()
    assert config == RunConfig()
    assert config.engine.model is None and config.engine.device == "auto" and config.output.ordered


def test_running_without_a_config_means_configs_default_yaml():
    assert load_config(CONFIGS / "default.yaml") == load_config()


@pytest.mark.parametrize("name", ["default.yaml", "cpu-small.yaml", "gpu-h200.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.engine.block_size >= 1
    assert config.sampling.get("max_tokens", 1) >= 1


def test_gpu_config_targets_cuda():
    config = load_config(CONFIGS / "gpu-h200.yaml")
    assert config.engine.device.startswith("cuda") and config.engine.dtype == "bfloat16"


def test_values_are_read_and_sizes_parsed(tmp_path):
    path = write(tmp_path, "block_size: 32\nkv_memory: 2GiB\nsampling:\n  temperature: 0\n"
                           "  stop: END\noutput:\n  ordered: false\n")
    config = load_config(path)
    assert config.engine.block_size == 32
    assert config.engine.kv_memory == 2 * 2**30
    assert config.sampling["temperature"] == 0.0 and config.sampling["stop"] == ["END"]
    assert config.sampling["top_p"] == 0.95  # untouched defaults stay
    assert config.output.ordered is False


def test_unknown_key_suggests_the_closest(tmp_path):
    path = write(tmp_path, "blok_size: 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: unknown key 'blok_size' (did you mean 'block_size'?)"


def test_unknown_nested_keys_name_their_section(tmp_path):
    with pytest.raises(ConfigError, match=r"x.yaml: sampling: unknown key 'temprature' \(did you mean 'temperature'"):
        load_config(write(tmp_path, "sampling:\n  temprature: 0.5\n"))
    with pytest.raises(ConfigError, match=r"x.yaml: unknown key 'output.pth' \(did you mean 'path'"):
        load_config(write(tmp_path, "output:\n  pth: a.jsonl\n"))


@pytest.mark.parametrize("text, fragment", [
    ("block_size: sixteen\n", "'block_size' must be an integer >= 1, got 'sixteen' (str)"),
    ("block_size: 0\n", "'block_size' must be an integer >= 1"),
    ("enable_prefix_caching: 1\n", "'enable_prefix_caching' must be true or false"),
    ("dtype: float64\n", "'dtype' must be one of"),
    ("device: tpu\n", "'device' must be 'auto', 'cpu'"),
    ("kv_memory: lots\n", "'kv_memory' must be a positive size"),
    ("max_num_seqs: 2.5\n", "'max_num_seqs' must be an integer"),
    ("sampling:\n  top_p: 0\n", "sampling: 'top_p' must be a number in (0.0, 1.0]"),
    ("sampling: [1, 2]\n", "'sampling' must be a mapping"),
    ("- a\n- b\n", "the top level must be a mapping"),
    ("block_size: [\n", "invalid YAML"),
])
def test_wrong_values_name_file_and_key(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path)) and fragment in str(info.value)


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "model: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        read_yaml(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_flags_override_the_file_and_name_the_flag(tmp_path):
    path = write(tmp_path, "block_size: 32\nkv_memory: 1GiB\nsampling:\n  top_k: 5\n")
    config = load_config(path, [("--num-blocks", {"num_blocks": 100}),
                                ("--temperature", {"sampling": {"temperature": 0.0}})])
    assert config.engine.block_size == 32
    assert config.engine.num_blocks == 100 and config.engine.kv_memory is None  # the flag replaces the budget
    assert config.sampling["top_k"] == 5 and config.sampling["temperature"] == 0.0
    with pytest.raises(ConfigError, match=r"^--block-size: 'block_size' must be an integer >= 1"):
        load_config(path, [("--block-size", {"block_size": 0})])


def test_set_option_parses_yaml_values():
    assert parse_set_option("sampling.top_k=20") == {"sampling": {"top_k": 20}}
    assert parse_set_option("model=default") == {"model": "default"}
    config = load_config(None, [("--set", parse_set_option("enable_prefix_caching=false")),
                                ("--set", parse_set_option("model=default"))])
    assert config.engine.enable_prefix_caching is False and config.engine.model is None
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_set_option("top_k")


@pytest.mark.parametrize("text, expected", [("2GiB", 2 * 2**30), ("512 MiB", 512 * 2**20),
                                            ("1.5GB", 1_500_000_000), (4096, 4096), ("100", 100)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "2 parsecs", "-1GiB", 0, True, 1.5])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)
