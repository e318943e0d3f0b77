"""What every runner shares: its command line, the workload file, the result line.

Standard library only: the vLLM runner runs under vLLM's venv, without pagedgen or rich.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Workload:
    """Requests of a run: prompt token ids and max_tokens, index-aligned, and what every request
    of the run shares: samples per prompt, temperature, the KV budget where the workload sets one.

    Outputs of a run are flat: request i's sample j at position i * n + j."""

    prompts: list[list[int]]
    max_tokens: list[int]
    description: str = ""
    name: str = "w64"
    n: int = 1                          # samples per prompt (vLLM's SamplingParams.n)
    temperature: float = 0.0            # 0: greedy
    seed: int = 0                       # sampling seed (engines that take one)
    shared_prefix_len: int = 0          # leading tokens every prompt has in common
    kv_bytes: int | None = None         # the workload's own KV budget; None: the run's --kv-gib

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"workload: {len(self.prompts)} prompts but {len(self.max_tokens)} max_tokens")
        if not self.prompts:
            raise ValueError("workload: no requests")
        if self.n < 1:
            raise ValueError(f"workload: n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"workload: temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def generated_tokens(self) -> int:
        return sum(self.max_tokens) * self.n

    @property
    def expected_lengths(self) -> list[int]:
        """Tokens each flat output must have: max_tokens of its request, n times in a row."""
        return [g for g in self.max_tokens for _ in range(self.n)]


def save_workload(workload: Workload, path: Path) -> None:
    Path(path).write_text(json.dumps(asdict(workload)))


def load_workload(path: Path) -> Workload:
    return Workload(**json.loads(Path(path).read_text()))


@dataclass(slots=True)
class RunnerResult:
    """The one JSON line a runner prints. Times in seconds, bytes for memory."""

    engine: str
    version: str
    threads: int
    dtype: str
    num_requests: int
    prompt_tokens: int
    generated_tokens: int     # counted from the outputs, so a short output shows here
    startup_s: float          # process spawn -> engine ready (imports, load, warm-up/compile)
    generate_s: float         # the generate call(s) alone
    kv_allocated_bytes: int | None = None   # the KV memory the engine holds (pool or cache tensors)
    kv_peak_bytes: int | None = None        # the most of it in use at once, where the engine tells
    preemptions: int | None = None          # sequences preempted, where the engine tells
    kernel_paths: list[str] = field(default_factory=list)   # the compute paths the engine took
    notes: list[str] = field(default_factory=list)

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.generate_s

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.generate_s


def runner_args(description: str) -> argparse.ArgumentParser:
    """The arguments every runner takes; a runner may add its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True,
                        help="model folder (safetensors + tokenizer), or a .gguf file")
    parser.add_argument("--workload", required=True, type=Path, help="workload JSON from the driver")
    parser.add_argument("--tokens-out", required=True, type=Path, help="where to write output token ids")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-gib", type=float, default=2.0, help="KV cache budget, GiB")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache element format (auto = the model's dtype)")
    parser.add_argument("--spawn-time", type=float, default=None,
                        help="time.time() at which the driver spawned this process")
    return parser


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """K and V of one token over every layer, from a transformers config object."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def check_args(args: argparse.Namespace) -> None:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.kv_gib <= 0:
        raise ValueError(f"--kv-gib must be > 0, got {args.kv_gib}")
    model = Path(args.model)
    if not (model.is_dir() or (model.suffix == ".gguf" and model.is_file())):
        raise ValueError(f"--model {args.model} is neither a model folder nor a .gguf file")


def seconds_since_spawn(spawn_time: float | None, process_start: float) -> float:
    """Start-up as seen from the driver when it passed --spawn-time, else from this script's start."""
    return time.time() - (spawn_time if spawn_time is not None else process_start)


def check_outputs(workload: Workload, outputs: list[list[int]], engine: str) -> None:
    """An engine that returns fewer or more tokens than asked would skew tokens/s: fail loudly.
    `outputs` is flat: request i's sample j at i * n + j."""
    expected = workload.expected_lengths
    if len(outputs) != len(expected):
        raise RuntimeError(f"{engine}: {len(outputs)} outputs for {len(workload.prompts)} requests "
                           f"x n={workload.n}")
    for i, (out, want) in enumerate(zip(outputs, expected)):
        if len(out) != want:
            raise RuntimeError(f"{engine}: request {i // workload.n} sample {i % workload.n} "
                               f"produced {len(out)} tokens, max_tokens={want}")


def unsupported(engine: str, reason: str) -> None:
    """The result line of an engine that cannot run this workload as specified (the table then
    says "unsupported" for the cell rather than a figure of a different workload); exits 0."""
    print(json.dumps({"engine": engine, "unsupported": reason}), flush=True)
    sys.exit(0)


def finish(result: RunnerResult, outputs: list[list[int]], tokens_out: Path) -> None:
    """Write the token ids and print the result line (the last line on stdout)."""
    Path(tokens_out).write_text(json.dumps(outputs))
    line = asdict(result) | {"generated_tok_s": result.generated_tok_s, "prompt_tok_s": result.prompt_tok_s}
    sys.stdout.flush()
    print(json.dumps(line), flush=True)


def env_threads(threads: int) -> None:
    """Pin OpenMP/MKL thread pools before torch is imported (torch reads them at import)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
