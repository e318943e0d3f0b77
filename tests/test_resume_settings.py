"""`--resume` refuses a run whose settings would change the answers: the manifest records every
setting the table marks changes_outputs, and the refusal names the one that differs. Settings
that change only speed (threads, batch limits, pool size) may change between the two runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.jobs.config import load_config
from pagedgen.jobs.manifest import differences, run_settings
from pagedgen.settings import TABLE, outputs_identity
from jsonl_files import write_jsonl
from tiny_models import write_tiny_run_config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A completed run of a tiny model (float32, greedy); returns its input and command."""
    folder = tmp_path_factory.mktemp("resume")
    inputs = write_jsonl(folder / "in.jsonl", [{"id": f"r{i}", "prompt": f"x = {i}"} for i in range(3)])
    config = write_tiny_run_config(folder / "tiny.yaml")
    command = [str(inputs), "--config", str(config), "--no-report"]
    result = CliRunner().invoke(app, ["run", *command])
    assert result.exit_code == 0, result.output
    return inputs, command


def test_the_manifest_records_every_setting_that_changes_outputs(finished_run):
    inputs, _ = finished_run
    recorded = run_settings(load_config(), inputs)
    assert set(outputs_identity()) <= set(recorded)
    assert not {s.name for s in TABLE if not s.changes_outputs} & set(recorded)


@pytest.mark.parametrize("name, value", [("kv_cache_dtype", "int8"), ("batch_invariant", True),
                                         ("weights", "dequantized"), ("dtype", "bfloat16"),
                                         ("tokenizer", "/elsewhere")])
def test_any_output_setting_that_differs_is_named(finished_run, name, value):
    inputs, _ = finished_run
    before = run_settings(load_config(), inputs)
    after = run_settings(load_config(None, [("test", {name: value})]), inputs)
    assert [line.split(":")[0] for line in differences(before, after)] == [name]


@pytest.mark.parametrize("flags, named", [
    (["--kv-cache-dtype", "int8"], "kv_cache_dtype: 'auto' -> 'int8'"),
    (["--batch-invariant"], "batch_invariant: False -> True"),
    (["--weights", "packed"], "weights: 'auto' -> 'packed'"),
    (["--dtype", "bfloat16"], "dtype: 'float32' -> 'bfloat16'"),
])
def test_resume_with_another_output_setting_is_refused_naming_it(finished_run, flags, named):
    inputs, command = finished_run
    output = inputs.with_name("in.completions.jsonl")
    before = output.read_bytes()
    result = CliRunner().invoke(app, ["run", *command, *flags, "--resume"])
    assert result.exit_code == 2, result.output
    assert "begun with other settings (1 differ)" in result.output and named in result.output
    assert output.read_bytes() == before


def test_resume_with_other_speed_settings_is_accepted(finished_run):
    inputs, command = finished_run
    result = CliRunner().invoke(app, ["run", *command, "--threads", "2", "--max-num-seqs", "2",
                                      "--max-num-batched-tokens", "64", "--no-prefix-caching",
                                      "--num-blocks", "32", "--resume"])
    assert result.exit_code == 0, result.output
