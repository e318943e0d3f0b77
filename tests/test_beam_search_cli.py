"""`pagedgen run` with "beam_width" lines: the record lists the beams best first, with scores."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pagedgen import LLM, BeamSearchParams
from pagedgen.cli.app import app
from tiny_models import tiny_model_dir, tiny_tokenizer


def test_beam_width_lines_run_beside_plain_ones_and_bad_combinations_are_named(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {tiny_model_dir('llama')}\ndtype: float32\ndevice: cpu\n"
                      "num_blocks: 64\nmax_num_seqs: 16\nmax_model_len: 64\nthreads: 1\n"
                      "sampling:\n  max_tokens: 5\n  temperature: 0\n  ignore_eos: true\n")
    lines = [{"id": "beams", "prompt": "def main():", "beam_width": 3, "length_penalty": 0.5},
             {"id": "plain", "prompt": "def main():"},
             {"id": "bad", "prompt": "x", "beam_width": 2, "n": 2},
             {"id": "lonely", "prompt": "x", "length_penalty": 2.0}]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(inputs), "-c", str(config), "-o", str(out),
                                      "--no-report"], catch_exceptions=False)
    assert result.exit_code != 2, result.output
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    beams = records["beams"]["outputs"]
    assert [b["index"] for b in beams] == [0, 1, 2]
    scores = [b["score"] for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert all(abs(b["cumulative_logprob"] / 5 ** 0.5 - b["score"]) < 1e-5 for b in beams)
    assert "score" not in records["plain"]["outputs"][0]

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_blocks=64, threads=1)
    expected = llm.beam_search(tiny_tokenizer().encode("def main():"),
                               BeamSearchParams(3, 5, ignore_eos=True, length_penalty=0.5),
                               use_tqdm=False)[0]
    assert [b["token_ids"] for b in beams] == [s.output_token_ids for s in expected.sequences]
    errors = {r["id"]: r["error"]["message"]
              for r in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert "'n' cannot be combined with 'beam_width'" in errors["bad"]
    assert "add 'beam_width'" in errors["lonely"]
