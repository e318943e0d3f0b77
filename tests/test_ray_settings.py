"""The `ray:` config section and the Ray flags of `pagedgen run`; none of this needs Ray."""

import re
import sys

import pytest
from typer.testing import CliRunner

from pagedgen.cli.app import _overrides, app
from pagedgen.jobs.config import ConfigError, load_config
from pagedgen.ray_data.config import ProcessorConfig


def test_ray_section_from_yaml_and_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ray:\n  enabled: true\n  replicas: 4\n  batch_size: 8\n  cpus_per_replica: 2\n")
    config = load_config(path)
    assert (config.ray.enabled, config.ray.replicas, config.ray.batch_size) == (True, 4, 8)
    assert config.ray.cpus_per_replica == 2 and config.ray.address is None
    # Naming an address or a replica count turns Ray on; --no-ray turns it off again.
    flags = load_config(None, _overrides({"--address": "auto", "--replicas": 3}, []))
    assert (flags.ray.enabled, flags.ray.address, flags.ray.replicas) == (True, "auto", 3)
    assert not load_config(path, _overrides({"--ray": False}, [])).ray.enabled
    assert not load_config().ray.enabled


@pytest.mark.parametrize("yaml_text, message", [
    ("ray:\n  replica: 2\n", "unknown key 'ray.replica' (did you mean 'replicas'?)"),
    ("ray:\n  replicas: 0\n", "'ray.replicas' must be an integer >= 1"),
    ("ray:\n  cpus_per_replica: -1\n", "'ray.cpus_per_replica' must be a positive number"),
    ("ray: 4\n", "'ray' must be a mapping"),
])
def test_ray_section_mistakes_name_the_key(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)


def test_stage_config_checks_its_values():
    with pytest.raises(ValueError, match="concurrency must be a positive integer"):
        ProcessorConfig(concurrency=0)
    with pytest.raises(ValueError, match="unknown option 'blok_size'"):
        ProcessorConfig(engine_kwargs={"blok_size": 16})
    config = ProcessorConfig(engine_kwargs={"threads": 3}, max_restarts=0, max_task_retries=0)
    assert config.map_batches_kwargs() == {"num_cpus": 3, "max_restarts": 0, "max_task_retries": 0}


def test_without_ray_the_option_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)                  # `import ray` fails
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"prompt": "a"}\n')
    result = CliRunner().invoke(app, ["run", str(inputs), "--ray"], catch_exceptions=False)
    assert result.exit_code == 2
    assert "pip install 'pagedgen[ray]'" in result.stderr
    assert not (tmp_path / "in.completions.jsonl").exists()
