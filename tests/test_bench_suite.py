"""The benchmark suite (bench/bench_peers.py --suite): seeded workload generators with the stated
shapes, the compute floor for n > 1 and shared prefixes, the static-batch budget plan, the CPU
report, and one quick end-to-end run of pagedgen alone on a tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH / "peers"))   # the runners import their helpers as `common`

from peers.common import Workload, check_outputs  # noqa: E402
from peers.cpu_info import cpu_info  # noqa: E402
from peers.floor import ModelShape, fewest_steps, kv_read_bytes, weight_bytes, workload_flops  # noqa: E402
from peers.run_hf_static import plan_batches  # noqa: E402
from peers.workload import SUITE, random_workload, suite_specs  # noqa: E402

TOKENS = (3, 8192)   # the bench tokenizer's ids above its special tokens
MIB = 2**20


def suite(quick: bool = False, seed: int = 0) -> dict[str, Workload]:
    return {s.name: random_workload(s, TOKENS) for s in suite_specs("all", quick, seed)}


def test_generators_are_deterministic_and_seeded():
    for quick in (False, True):
        first, again, other = suite(quick), suite(quick), suite(quick, seed=1)
        assert list(first) == list(SUITE)
        for name, workload in first.items():
            assert workload == again[name], name
            assert workload.prompts != other[name].prompts, name


def in_range(values, low, high) -> bool:
    return all(low <= v <= high for v in values)


def test_full_scale_shapes():
    w = suite()
    w64 = w["w64"]
    assert len(w64.prompts) == 64 and w64.n == 1 and w64.greedy and w64.kv_bytes is None
    assert in_range(map(len, w64.prompts), 32, 512) and in_range(w64.max_tokens, 16, 256)

    long = w["long"]
    assert len(long.prompts) == 16 and set(long.max_tokens) == {64}
    assert in_range(map(len, long.prompts), 6000, 7500)

    shared = w["shared-prefix"]
    assert len(shared.prompts) == 128 and set(shared.max_tokens) == {64}
    assert shared.shared_prefix_len == 1500
    prefix = shared.prompts[0][:1500]
    assert all(p[:1500] == prefix for p in shared.prompts)
    assert in_range((len(p) - 1500 for p in shared.prompts), 50, 200)
    assert len({tuple(p[1500:]) for p in shared.prompts}) == 128   # own suffixes

    parallel = w["parallel"]
    assert len(parallel.prompts) == 32 and parallel.n == 8 and parallel.temperature == 1.0
    assert in_range(map(len, parallel.prompts), 256, 512) and set(parallel.max_tokens) == {128}
    assert parallel.generated_tokens == 32 * 8 * 128
    assert parallel.expected_lengths == [128] * 256

    tight = w["tight"]   # w64's requests inside a 128 MiB budget
    assert tight.prompts == w64.prompts and tight.max_tokens == w64.max_tokens
    assert tight.kv_bytes == 128 * MIB

    assert len(w["small-job"].prompts) == 8
    for workload in w.values():
        assert in_range((t for p in workload.prompts for t in p), TOKENS[0], TOKENS[1] - 1)


def test_quick_scale_keeps_each_feature_small():
    full, quick = suite(), suite(quick=True)
    for name in SUITE:
        assert quick[name].prompt_tokens < full[name].prompt_tokens
        assert (quick[name].n, quick[name].temperature) == (full[name].n, full[name].temperature)
    assert quick["shared-prefix"].shared_prefix_len > 0
    assert quick["tight"].kv_bytes is not None and min(map(len, quick["long"].prompts)) >= 1200


def test_suite_names_are_checked():
    assert [s.name for s in suite_specs("tight, long", False, 0)] == ["tight", "long"]
    with pytest.raises(ValueError, match="unknown.*nope"):
        suite_specs("w64,nope", False, 0)


SHAPE = ModelShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=32)


def reference_flops(prompt_lens, gens, n=1, prefix=0) -> float:
    """Token by token: every computed position p costs 2 x params + attention over p + 1 keys."""
    def position(p):
        return 2 * SHAPE.params_per_token + 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * (p + 1)
    total = sum(position(p) for p in range(prefix))
    for length, g in zip(prompt_lens, gens):
        total += sum(position(p) for p in range(prefix, length))
        total += n * sum(position(p) for p in range(length, length + g - 1))
        total += n * 2 * SHAPE.hidden * SHAPE.vocab * g
    return total


def test_floor_counts_samples_and_a_shared_prefix_once():
    plain = Workload([[1] * 5, [1] * 9], [3, 4])
    assert workload_flops(SHAPE, plain) == pytest.approx(reference_flops([5, 9], [3, 4]))
    sampled = replace(plain, n=3, temperature=1.0)
    assert workload_flops(SHAPE, sampled) == pytest.approx(reference_flops([5, 9], [3, 4], n=3))
    shared = replace(plain, shared_prefix_len=4)
    assert workload_flops(SHAPE, shared) == pytest.approx(reference_flops([5, 9], [3, 4], prefix=4))
    assert workload_flops(SHAPE, shared) < workload_flops(SHAPE, plain)


def test_floor_counts_a_sliding_layer_s_window_only():
    # One of the two layers sees the last 3 keys: position p costs min(p + 1, 3) there.
    sliding = replace(SHAPE, sliding_layers=1, window=3)
    workload = Workload([[1] * 5, [1] * 9], [3, 4])
    per_key = 4 * SHAPE.heads * SHAPE.head_dim
    fewer = sum(per_key * (p + 1 - min(p + 1, 3)) for length, g in ((5, 3), (9, 4))
                for p in range(length + g - 1))
    assert workload_flops(sliding, workload) == pytest.approx(workload_flops(SHAPE, workload) - fewer)
    config = {"num_attention_heads": 2, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 6, "vocab_size": 32, "sliding_window": 512,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert (ModelShape.from_config(config).sliding_layers, ModelShape.from_config(config).window) == (5, 512)
    assert ModelShape.from_config({**config, "use_sliding_window": False}).sliding_layers == 0
    assert kv_read_bytes(sliding, workload, 2.0, 4) < kv_read_bytes(SHAPE, workload, 2.0, 4)


def reference_kv_blocks(workload: Workload, block_size: int) -> int:
    """Brute force: simulate the fewest-steps schedule and count the distinct physical blocks
    read at every step, as sets of (owner, block index)."""
    total = 0
    for step in range(1, max(workload.max_tokens)):
        read = set()
        for i, (prompt, g) in enumerate(zip(workload.prompts, workload.max_tokens)):
            if step >= g:
                continue
            for t in range(len(prompt)):
                owner = "prefix" if t < workload.shared_prefix_len else ("prompt", i)
                read.add((owner, t // block_size) if owner == "prefix" else
                         (owner, (t - workload.shared_prefix_len) // block_size))
            for sample in range(workload.n):
                for t in range(step):
                    read.add((("sample", i, sample), t // block_size))
        total += len(read)
    return total


def test_memory_floor_reads_shared_blocks_once_per_step():
    per_block = SHAPE.kv_bytes_per_token(2.0) * 4
    cases = [Workload([[1] * 5, [1] * 9], [3, 6]),
             Workload([[1] * 7, [1] * 13], [5, 2], n=3, temperature=1.0),
             Workload([[1] * 10, [1] * 12, [1] * 11], [4, 9, 1], shared_prefix_len=8)]
    for workload in cases:
        assert kv_read_bytes(SHAPE, workload, 2.0, block_size=4) == \
            pytest.approx(reference_kv_blocks(workload, 4) * per_block)
    plain, shared = cases[2], replace(cases[2], shared_prefix_len=0)
    assert kv_read_bytes(SHAPE, plain, 2.0, 4) < kv_read_bytes(SHAPE, shared, 2.0, 4)
    assert weight_bytes(SHAPE, 9, 2.0) == 9 * 2.0 * (SHAPE.params_per_token + SHAPE.vocab * SHAPE.hidden)


def first_come_steps(workload: Workload, budget_tokens: int) -> int:
    """Steps of one schedule that keeps every step inside the budget: requests admitted in
    order while the pool holds what they will grow to, each run to its end, one token a step."""
    pending = list(zip(map(len, workload.prompts), workload.max_tokens))
    running: list[list[int]] = []   # [prompt, max_tokens, steps done]
    steps = 0
    while pending or running:
        while pending and sum(p + g - 1 for p, g, _ in running) + sum(pending[0]) - 1 <= budget_tokens:
            running.append([*pending.pop(0), 0])
        assert running, "a request larger than the budget"
        for request in running:
            request[2] += 1
        running = [r for r in running if r[2] < r[1]]
        steps += 1
    return steps


def test_fewest_steps_count_what_the_kv_budget_holds():
    per_token = SHAPE.kv_bytes_per_token(2.0)
    workload = Workload([[1] * 40, [1] * 30, [1] * 50, [1] * 20], [12, 30, 8, 25])
    assert fewest_steps(SHAPE, workload) == 30
    assert fewest_steps(SHAPE, workload, 2.0, 10**9) == 30
    for budget_tokens in (60, 80, 120, 200):
        bound = fewest_steps(SHAPE, workload, 2.0, budget_tokens * per_token)
        assert 30 <= bound <= first_come_steps(workload, budget_tokens), budget_tokens
    held = sum(g * p + g * (g - 1) // 2 for p, g in ((40, 12), (30, 30), (50, 8), (20, 25)))
    assert fewest_steps(SHAPE, workload, 2.0, 60 * per_token) == -(-held // 60) > 30
    # 8-bit K/V: the same budget holds twice the tokens.
    assert fewest_steps(SHAPE, workload, 1.0, 60 * per_token / 2) == -(-held // 60)
    # A sliding layer holds its window at most; a shared prefix and the prompt of n samples once.
    sliding = replace(SHAPE, sliding_layers=1, window=4)
    assert fewest_steps(sliding, workload, 2.0, 60 * per_token) < fewest_steps(SHAPE, workload, 2.0, 60 * per_token)
    sampled = replace(workload, n=2, temperature=1.0)
    own = sum(g * p + 2 * g * (g - 1) // 2 for p, g in ((40, 12), (30, 30), (50, 8), (20, 25)))
    assert fewest_steps(SHAPE, sampled, 2.0, 60 * per_token) == -(-own // 60)


def test_outputs_are_checked_flat_with_n_samples():
    workload = Workload([[1, 2], [3]], [2, 1], n=2, temperature=1.0)
    check_outputs(workload, [[5, 5], [6, 6], [7], [8]], "engine")
    with pytest.raises(RuntimeError, match="request 1 sample 1 produced 2 tokens"):
        check_outputs(workload, [[5, 5], [6, 6], [7], [8, 8]], "engine")
    with pytest.raises(RuntimeError, match="3 outputs for 2 requests x n=2"):
        check_outputs(workload, [[5, 5], [6, 6], [7]], "engine")


def test_static_batches_fit_the_budget():
    workload = Workload([[1] * 10] * 5, [6] * 5, n=2)   # 16 positions x 2 rows per request
    assert plan_batches(workload, 16, budget=10**6, per_token=1) == [slice(0, 5)]
    assert plan_batches(workload, 2, budget=10**6, per_token=1) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert plan_batches(workload, 16, budget=64, per_token=1) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    with pytest.raises(ValueError, match="request 0 alone needs"):
        plan_batches(workload, 16, budget=31, per_token=1)


def test_cpu_report_reads_model_and_features():
    info = cpu_info("model name\t: Some CPU 9000\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert info.model == "Some CPU 9000"
    assert info.features == {"AMX": False, "AVX-512 BF16": True, "AVX-512": True, "AVX2": True}
    assert "AMX no, AVX-512 BF16 yes" in info.summary()


def test_a_workload_budget_goes_to_every_engine(tmp_path):
    import bench_peers

    args = bench_peers.parse_args(["--suite", "tight,w64", "--kv-gib", "2"])
    tight, w64 = suite()["tight"], suite()["w64"]
    for engine in bench_peers.RUNNERS:
        command = bench_peers.runner_command(engine, Path(sys.executable), args, tmp_path, tight,
                                             tmp_path / "w.json", tmp_path)
        assert float(command[command.index("--kv-gib") + 1]) * 2**30 == 128 * MIB
    command = bench_peers.runner_command("pagedgen", Path(sys.executable), args, tmp_path, w64,
                                         tmp_path / "w.json", tmp_path)
    assert float(command[command.index("--kv-gib") + 1]) == 2.0
    with pytest.raises(SystemExit, match="unknown"):
        bench_peers.parse_args(["--suite", "w65"])


def test_peer_dtype_goes_to_every_engine_but_pagedgen(tmp_path):
    import bench_peers

    args = bench_peers.parse_args(["--dtype", "bfloat16", "--peer-dtype", "float32"])
    w64 = suite()["w64"]
    for engine in bench_peers.RUNNERS:
        command = bench_peers.runner_command(engine, Path(sys.executable), args, tmp_path, w64,
                                             tmp_path / "w.json", tmp_path)
        expected = "bfloat16" if engine.startswith("pagedgen") else "float32"
        assert command[command.index("--dtype") + 1] == expected
    alike = bench_peers.parse_args(["--dtype", "float32"])
    command = bench_peers.runner_command("vllm", Path(sys.executable), alike, tmp_path, w64,
                                         tmp_path / "w.json", tmp_path)
    assert command[command.index("--dtype") + 1] == "float32"


def test_suite_runs_end_to_end_for_pagedgen(tmp_path):
    """The workload with the most engine features (n = 8 at temperature 1, forks) through the
    real driver and runner processes, on a tiny model, --quick scale. (All six take ~40 s on a
    shared 2-core machine: too long for the fast suite.)"""
    from tiny_models import tiny_model_dir

    model = tiny_model_dir("llama", max_position_embeddings=2048)
    out = tmp_path / "suite.json"
    env = dict(os.environ, PAGEDGEN_NATIVE_KERNELS="0")   # no kernel build in a fresh checkout
    command = [sys.executable, str(BENCH / "bench_peers.py"), "--suite", "parallel", "--quick",
               "--engines", "pagedgen", "--model", str(model), "--threads", "1", "--dtype", "float32",
               "--kv-gib", "0.0625", "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "CPU " in done.stdout and "pagedgen kernel paths: projections" in done.stdout
    assert "Suite: workload x engine" in done.stdout

    result = json.loads(out.read_text())
    (entry,) = result["workloads"]
    assert entry["workload_name"] == "parallel"
    (run,) = entry["engines"]
    assert run["status"] == "ok", run
    assert run["result"]["generated_tokens"] == entry["generated_tokens"] == 4 * 8 * 12
    assert run["result"]["preemptions"] is not None and run["floor_multiple"] > 1
    tokens = json.loads((tmp_path / "work" / "parallel" / "pagedgen.tokens.json").read_text())
    assert len(tokens) == 4 * 8 and all(len(t) == 12 for t in tokens)
    assert len({tuple(t) for t in tokens}) > 4   # temperature 1: the samples differ


def test_gguf_engines_run_the_file_and_the_rest_the_folder(tmp_path):
    """--weights packed: pagedgen runs the GGUF file's blocks as stored, pagedgen_dequantized the
    same file dequantized at load, llama_cpp the file in its own interpreter; the other engines
    keep the model folder."""
    import bench_peers

    args = bench_peers.parse_args(["--model", "default", "--weights", "packed", "--engines",
                                   "pagedgen,pagedgen_dequantized,llama_cpp,vllm",
                                   "--llama-python", sys.executable])
    args.gguf = tmp_path / "m.gguf"
    w64 = suite()["w64"]

    def command(engine):
        return bench_peers.runner_command(engine, Path(sys.executable), args, tmp_path / "folder",
                                          w64, tmp_path / "w.json", tmp_path)

    for engine, weights in (("pagedgen", "packed"), ("pagedgen_dequantized", "dequantized")):
        line = command(engine)
        assert line[line.index("--model") + 1] == str(args.gguf)
        assert line[line.index("--weights") + 1] == weights
        assert line[1].endswith("run_pagedgen.py")
    assert command("llama_cpp")[1].endswith("run_llama_cpp.py")
    assert command("llama_cpp")[command("llama_cpp").index("--model") + 1] == str(args.gguf)
    assert command("vllm")[command("vllm").index("--model") + 1] == str(tmp_path / "folder")
    assert bench_peers.runner_python("llama_cpp", args) == Path(sys.executable)
    with pytest.raises(SystemExit, match="add --weights packed"):
        bench_peers.parse_args(["--engines", "pagedgen,llama_cpp"])
    with pytest.raises(SystemExit, match="--model must be one of"):
        bench_peers.parse_args(["--model", "bench", "--weights", "packed"])


def test_the_llama_cpp_runner_declines_what_its_loop_cannot_run(tmp_path):
    """Sampled or n > 1 workloads get an "unsupported" line (the table says so) rather than a
    figure for another workload; it exits before importing llama_cpp."""
    from peers.common import save_workload

    workload_path = tmp_path / "w.json"
    save_workload(suite()["parallel"], workload_path)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    done = subprocess.run([sys.executable, str(BENCH / "peers" / "run_llama_cpp.py"), "--model",
                           str(tmp_path / "m.gguf"), "--workload", str(workload_path),
                           "--tokens-out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, check=True)
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["engine"] == "llama_cpp" and "greedy" in line["unsupported"]
