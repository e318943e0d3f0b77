"""One place for each setting: the settings table is what LLM(), the YAML config, the CLI flags,
configs/default.yaml, the Ray stage and the run manifest accept, with one default and one error
per setting; nothing else names a setting with a default of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.jobs.config import ConfigError, RunConfig, load_config
from pagedgen.settings import ALIASES, LLM_SETTINGS, SETTINGS, TABLE, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("sampling", "output", "ray")

# A value each kind refuses that the CLI still parses into its flag type (so the table's check,
# not click, answers it).
BAD = {"int": 0, "size": "lots", "choice": "nope", "device": "tpu", "path": "", "bool": 1}
# The flags of each command that are not settings (sections, workload, files, modes).
OWN_FLAGS = {
    "run": {"--config", "--output", "--errors", "--report-dir", "--no-report", "--ordered",
            "--resume", "--overwrite", "--quiet", "--max-tokens", "--temperature", "--top-p",
            "--top-k", "--n", "--set", "--debug", "--ray", "--address", "--replicas", "--help"},
    "profile": {"--block-size", "--config", "--num-requests", "--prompt-len", "--max-tokens",
                "--json", "--quiet", "--help"},
    "inspect-memory": {"--config", "--seq-len", "--report", "--step", "--request", "--sample",
                       "--token", "--json", "--help"},
}


def bad_value(setting):
    return BAD[setting.kind] if setting.minimum != 0 else -1


def requirement(setting, value) -> str:
    with pytest.raises(ValueError) as info:
        setting.check(value)
    return str(info.value)


def command_options(command: str) -> dict[str, object]:
    """flag -> click option of a command, from the Typer app."""
    import typer.main

    click_command = typer.main.get_command(app).commands[command]
    return {decl: param for param in click_command.params for decl in param.opts}


# --- every entry accepted everywhere, one default ---

@pytest.mark.parametrize("setting", LLM_SETTINGS, ids=lambda s: s.name)
def test_llm_and_engine_config_take_the_table_default(setting):
    assert getattr(EngineConfig(), setting.name) == setting.default
    assert getattr(EngineConfig.of(**{setting.name: setting.default}), setting.name) == setting.default


@pytest.mark.parametrize("setting", TABLE, ids=lambda s: s.name)
def test_yaml_and_configs_default_yaml_take_the_table_default(setting):
    holder = lambda config: config.engine if setting.llm else config  # noqa: E731
    assert getattr(holder(load_config()), setting.name) == setting.default
    shipped = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    assert setting.check(shipped[setting.name]) == setting.default


@pytest.mark.parametrize("setting", TABLE, ids=lambda s: s.name)
def test_every_command_of_the_entry_has_its_flag_with_help_and_default(setting):
    for command in setting.commands:
        options = command_options(command)
        assert setting.flag_name in options, (command, setting.flag_name)
        option = options[setting.flag_name]
        assert setting.help in option.help and setting.shown_default in option.show_default
        if not option.multiple:  # profile's --block-size: repeat it to compare block sizes
            assert option.help == setting.help and option.default is None
        if setting.kind == "bool":
            assert option.secondary_opts == ["--no-" + setting.flag_name[2:]]


# --- one error for a bad value ---

@pytest.mark.parametrize("setting", TABLE, ids=lambda s: s.name)
def test_a_bad_value_gets_the_same_error_from_llm_yaml_and_the_cli(tmp_path, setting):
    from pagedgen import LLM

    bad = bad_value(setting)
    rule = requirement(setting, bad)
    expected = f"{setting.name} {rule}"
    if setting.llm:
        with pytest.raises(ValueError) as info:  # before any model is loaded
            LLM(**{setting.name: bad})
        assert str(info.value).startswith(expected), str(info.value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({setting.name: bad}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"'{setting.name}' {rule}" in str(info.value)
    if setting.kind == "bool":
        return  # a --x/--no-x flag cannot carry a bad value
    command = setting.commands[0]
    args = ["prompts.jsonl"] if command == "run" else []
    result = CliRunner().invoke(app, [command, *args, setting.flag_name, str(bad)])
    assert result.exit_code == 2
    assert f"{setting.flag_name}: '{setting.name}' {rule}" in " ".join(result.output.split())


def test_an_unknown_llm_setting_is_refused_with_the_closest_name():
    from pagedgen import LLM

    with pytest.raises(TypeError, match=r"unknown setting 'blok_size' \(did you mean 'block_size'\?\)"):
        LLM(blok_size=16)


def test_a_path_setting_takes_a_pathlib_path():
    assert EngineConfig.of(model=Path("m.gguf"), tokenizer=Path("t")).model == "m.gguf"


def test_the_vllm_alias_is_the_same_setting():
    assert EngineConfig.of(num_gpu_blocks=7).num_blocks == 7
    with pytest.raises(ValueError, match="give num_blocks or num_gpu_blocks"):
        EngineConfig.of(num_blocks=6, num_gpu_blocks=7)


@pytest.mark.parametrize("settings, message", [
    (dict(num_blocks=4, kv_memory=2**20), "give num_blocks or kv_memory, not both"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "must be >= max_num_seqs"),
    (dict(batch_invariant=True, kv_cache_dtype="int8"), "batch_invariant=True needs kv_cache_dtype='auto'"),
])
def test_rules_between_settings_are_checked_once_for_llm_and_yaml(tmp_path, settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig.of(**settings)
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    if "num_blocks" in settings:  # in a file, the later of the two replaces the other
        assert load_config(path).engine.num_blocks is None
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


# --- the reverse: nothing accepts a setting the table does not have ---

def test_every_llm_argument_is_a_table_entry():
    from dataclasses import fields

    assert [f.name for f in fields(EngineConfig)] == [s.name for s in LLM_SETTINGS]
    assert set(ALIASES.values()) <= set(SETTINGS)


@pytest.mark.parametrize("command", OWN_FLAGS)
def test_every_setting_flag_of_a_command_is_a_table_entry(command):
    flags = {flag for flag in command_options(command) if flag.startswith("--")}
    settings = {s.flag_name for s in TABLE if command in s.commands}
    negations = {"--no-" + f[2:] for f in settings}
    assert flags - OWN_FLAGS[command] - negations == settings - OWN_FLAGS[command]


def test_every_yaml_key_is_a_table_entry():
    keys = set(yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()))
    assert keys - set(SECTIONS) == set(SETTINGS)
    for name in ("cpu-small.yaml", "gpu-h200.yaml"):
        assert set(yaml.safe_load((ROOT / "configs" / name).read_text())) - set(SECTIONS) <= set(SETTINGS)


def test_the_ray_stage_takes_the_llm_settings():
    from pagedgen.ray_data.config import ENGINE_KWARGS, ProcessorConfig

    assert set(ENGINE_KWARGS) == {s.name for s in LLM_SETTINGS} - {"model"}
    with pytest.raises(ValueError, match="unknown option 'blok_size'"):
        ProcessorConfig(engine_kwargs={"blok_size": 16})


def test_a_run_config_holds_the_engine_config_not_copies():
    from dataclasses import fields

    names = {f.name for f in fields(RunConfig)}
    assert "engine" in names and not names & {s.name for s in LLM_SETTINGS}


def test_choices_match_what_the_layers_below_implement():
    from pagedgen.kernels.kv_quant import KV_CACHE_DTYPES
    from pagedgen.model.loading.loader import WEIGHTS_FORMATS

    assert SETTINGS["kv_cache_dtype"].choices == KV_CACHE_DTYPES
    assert set(WEIGHTS_FORMATS) <= set(SETTINGS["weights"].choices)


def test_unknown_weights_format_is_refused_clearly():
    from pagedgen.model.loading.loader import load_model

    with pytest.raises(ValueError, match="weights must be one of auto, packed, dequantized"):
        load_model(None, weights="int4")


# --- no default of its own outside the table ---

SETTING_NAMES = set(SETTINGS) | set(ALIASES)
# Fields that share a setting's name but hold something else.
NOT_SETTINGS = {
    ("pagedgen/model/loading/loader.py", "LoadedModel.dtype"),    # the resolved torch.dtype
    ("pagedgen/model/loading/loader.py", "LoadedModel.device"),   # the resolved torch.device
    ("pagedgen/jobs/output_files.py", "RequestResult.model"),     # the model's name in a record
    ("kernels/kv_quant.py", "dequantize.dtype"),                  # the output tensor's dtype
}


def _allowed_default(name: str, node: ast.expr | None) -> bool:
    """No default, None ("not given"), the table's own (`default("name")`), or a Typer option
    whose default is "not given" (None or an empty list)."""
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return True
    if isinstance(node, ast.Call):
        func = ast.unparse(node.func)
        first = node.args[0] if node.args else None
        if func == "default":
            return isinstance(first, ast.Constant) and first.value == name
        if func == "typer.Option":
            return (isinstance(first, ast.Constant) and first.value is None) or \
                (isinstance(first, ast.List) and not first.elts)
    return False


def _defaults(tree: ast.AST):
    """(owner.name, parameter, default) for every function parameter and dataclass field."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            padded = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
            for arg, value in [*zip(positional, padded), *zip(args.kwonlyargs, args.kw_defaults)]:
                yield f"{node.name}.{arg.arg}", arg.arg, value
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    yield f"{node.name}.{item.target.id}", item.target.id, item.value


def test_no_parameter_named_after_a_setting_has_a_default_of_its_own():
    own = []
    for folder in ("pagedgen", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if relative.startswith("pagedgen/settings/"):
                continue
            for where, name, value in _defaults(ast.parse(path.read_text())):
                if name in SETTING_NAMES and (relative, where) not in NOT_SETTINGS \
                        and not _allowed_default(name, value):
                    own.append(f"{relative}: {where} = {ast.unparse(value)}")
    assert not own, "defaults outside the settings table:\n" + "\n".join(own)


def test_the_ast_check_sees_a_stray_default():
    stray = ast.parse("def f(block_size: int = 16): pass\nclass C:\n    seed: int = 0\n")
    found = [(w, n) for w, n, v in _defaults(stray) if not _allowed_default(n, v)]
    assert found == [("f.block_size", "block_size"), ("C.seed", "seed")]
