"""The vLLM peer of the benchmarks, without vLLM: skipping when it is not installed, the checks
its beam-search and structured-outputs runners make on vLLM's outputs, the ratio tables, and
the size of the KV pool the suite runner reports for it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parents[1] / "bench"
for folder in (BENCH, BENCH / "peers"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import bench_beam_search  # noqa: E402
import bench_structured  # noqa: E402
import run_vllm  # noqa: E402
import run_vllm_beam  # noqa: E402
import run_vllm_structured  # noqa: E402
from peers.common import Workload  # noqa: E402
from peers.vllm_peer import add_vllm_args, vllm_wanted  # noqa: E402


def vllm_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_vllm_args(parser)
    return parser.parse_args(argv)


def test_vllm_is_skipped_with_the_install_command_when_absent(tmp_path, capsys):
    assert not vllm_wanted(vllm_args(["--vllm-venv", str(tmp_path / "no-venv")]))
    assert "install_vllm.py" in capsys.readouterr().out
    assert not vllm_wanted(vllm_args(["--no-vllm"]))


def beam(tokens):
    return SimpleNamespace(tokens=tokens)


def test_beam_runner_rejects_short_or_missing_beams():
    workload = Workload(prompts=[[5, 6], [7]], max_tokens=[2, 2])
    good = [SimpleNamespace(sequences=[beam([5, 6, 1, 2]), beam([5, 6, 1, 3])]),
            SimpleNamespace(sequences=[beam([7, 1, 1]), beam([7, 2, 2])])]
    assert run_vllm_beam.beam_lengths_ok(good, workload, 2)
    assert not run_vllm_beam.beam_lengths_ok(good, workload, 3)           # too few beams
    short = [good[0], SimpleNamespace(sequences=[beam([7, 1]), beam([7, 2, 2])])]
    assert not run_vllm_beam.beam_lengths_ok(short, workload, 2)          # a beam that stopped early


def test_structured_runner_counts_parsed_complete_and_cut_outputs():
    def result(text, reason):
        return SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason=reason)])
    results = [result('{"a": 1}', "stop"), result('{"a": ', "stop"), result('{"a": "xy', "length")]
    assert run_vllm_structured.json_outcomes(results) == {
        "complete_and_parsed": 1, "complete": 2, "cut_by_max_tokens": 1}


def test_structured_table_puts_both_engines_and_their_ratios():
    def side(unconstrained, constrained):
        return {"gen_tok_per_s": {"unconstrained": unconstrained, "constrained": constrained},
                "throughput_ratio": constrained / unconstrained, "generated_tokens":
                {"unconstrained": 100, "constrained": 90},
                "json_outputs": {"complete_and_parsed": 3, "complete": 3, "cut_by_max_tokens": 1}}
    result = side(200.0, 190.0)
    bench_structured.add_vllm_result(result, {**side(100.0, 50.0), "backend": "auto: xgrammar"})
    assert result["pagedgen_vs_vllm"] == {"unconstrained": 2.0, "constrained": 3.8}
    table = bench_structured.markdown_table(result)
    assert "| vLLM (auto: xgrammar) | 100.0 | 50.0 | 0.50 |" in table
    assert "| pagedgen / vLLM | 2.00× | 3.80× |" in table
    no_vllm = side(1.0, 1.0)
    bench_structured.add_vllm_result(no_vllm, None)
    assert "vllm" not in no_vllm


def test_beam_table_has_a_ratio_per_peer_and_dashes_for_a_missing_one():
    ours = {"beam_tok_s": 90.0, "peak_blocks": 1200, "no_sharing_blocks": 4000, "saved_fraction": 0.7}
    results = {"widths": {4: {"pagedgen": ours, "vllm": {"beam_tok_s": 30.0}},
                          8: {"pagedgen": ours, "transformers": {"beam_tok_s": 45.0}}}}
    lines = bench_beam_search.markdown_table(results).splitlines()
    assert lines[2] == "| 4 | 90.0 | 30.0 | 3.00× | - | - | 1,200 | 4,000 | 70.0% |"
    assert lines[3] == "| 8 | 90.0 | - | - | 45.0 | 2.00× | 1,200 | 4,000 | 70.0% |"


def _vllm_llm(num_blocks: int, layer_types: list[str] | None) -> SimpleNamespace:
    """What allocated_kv_bytes reads of a vLLM LLM: 18 layers, 1 KV head of 256, bf16."""
    hf = SimpleNamespace(num_hidden_layers=18, num_key_value_heads=1, layer_types=layer_types)
    model = SimpleNamespace(hf_text_config=hf, get_head_size=lambda: 256,
                            dtype=SimpleNamespace(itemsize=2))
    cache = SimpleNamespace(num_gpu_blocks=num_blocks, block_size=128, cache_dtype="auto")
    return SimpleNamespace(llm_engine=SimpleNamespace(
        vllm_config=SimpleNamespace(cache_config=cache, model_config=model)))


def test_vllm_kv_pool_is_its_blocks_or_the_budget_where_layers_differ():
    one_kind = run_vllm.allocated_kv_bytes(_vllm_llm(64, ["full_attention"] * 18), 1 << 30)
    assert one_kind == (64 * 128 * 2 * 18 * 256 * 2, "64 blocks of 128")
    # Gemma 3: a block holds one group of layers, so blocks x every layer's bytes overstates
    mixed = ["sliding_attention"] * 5 + ["full_attention"]
    two_kinds = run_vllm.allocated_kv_bytes(_vllm_llm(5461, mixed * 3), 128 << 20)
    assert two_kinds[0] == 128 << 20 and "configured" in two_kinds[1]
