"""The benchmark's workload: seeded random requests, or real prompts from a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from peers.common import Workload


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: tuple[int, int]      # inclusive range, uniform (after the shared prefix, if any)
    max_tokens: tuple[int, int]      # inclusive range, uniform
    seed: int = 0
    name: str = "w64"
    shared_prefix: int = 0           # tokens of one common prefix (a system prompt) before each prompt
    n: int = 1                       # samples per prompt
    temperature: float = 0.0         # 0: greedy
    kv_mib: int | None = None        # the workload's own KV budget; None: the run's --kv-gib

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name in ("prompt_len", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {low}..{high}")
        if self.shared_prefix < 0 or self.n < 1 or self.temperature < 0:
            raise ValueError(f"shared_prefix >= 0, n >= 1, temperature >= 0 needed, got "
                             f"{self.shared_prefix}, {self.n}, {self.temperature}")
        if self.kv_mib is not None and self.kv_mib < 1:
            raise ValueError(f"kv_mib must be >= 1, got {self.kv_mib}")

    def describe(self) -> str:
        text = (f"{self.num_requests} requests, random token ids, prompt {self.prompt_len[0]}.."
                f"{self.prompt_len[1]}")
        if self.shared_prefix:
            text += f" after a shared {self.shared_prefix}-token prefix"
        text += f", max_tokens {self.max_tokens[0]}..{self.max_tokens[1]}"
        if self.n > 1:
            text += f", n={self.n}"
        text += f", temperature {self.temperature:g}" if self.temperature else ", greedy"
        if self.kv_mib is not None:
            text += f", KV budget {self.kv_mib} MiB"
        return text + f", seed {self.seed}"


FULL = WorkloadSpec(num_requests=64, prompt_len=(32, 512), max_tokens=(16, 256))
QUICK = WorkloadSpec(num_requests=6, prompt_len=(8, 48), max_tokens=(4, 12))

# The suite: name -> (full scale, --quick scale). The quick scale keeps each workload's feature
# (long prompts, a shared prefix, n = 8 at temperature 1, a budget that preempts) at a size a
# smoke test runs in seconds.
SUITE: dict[str, tuple[WorkloadSpec, WorkloadSpec]] = {
    "w64": (FULL, QUICK),
    "long": (WorkloadSpec(16, (6000, 7500), (64, 64), name="long"),
             WorkloadSpec(2, (1200, 1500), (8, 8), name="long")),
    "shared-prefix": (WorkloadSpec(128, (50, 200), (64, 64), name="shared-prefix", shared_prefix=1500),
                      WorkloadSpec(8, (5, 20), (8, 8), name="shared-prefix", shared_prefix=150)),
    "parallel": (WorkloadSpec(32, (256, 512), (128, 128), name="parallel", n=8, temperature=1.0),
                 WorkloadSpec(4, (26, 51), (12, 12), name="parallel", n=8, temperature=1.0)),
    # Quick: requests large enough that 16 MiB (~730 tokens of the bench model) preempts, in a
    # budget that still holds vLLM's smallest max_model_len (256, it rounds up) in its blocks
    # of 128 tokens.
    "tight": (replace(FULL, name="tight", kv_mib=128),
              WorkloadSpec(8, (64, 128), (32, 64), name="tight", kv_mib=16)),
    "small-job": (WorkloadSpec(8, (32, 512), (16, 256), name="small-job"),
                  WorkloadSpec(3, (8, 48), (4, 12), name="small-job")),
}


def scaled(spec: WorkloadSpec, fraction: float) -> WorkloadSpec:
    """Fewer requests of the same shape; a workload's own KV budget shrinks with them (so that
    `tight` still preempts), but never below 32 MiB (one w64 request must fit the bench model)."""
    kv_mib = None if spec.kv_mib is None else max(32, round(spec.kv_mib * fraction))
    return replace(spec, num_requests=max(1, round(spec.num_requests * fraction)), kv_mib=kv_mib)


def suite_specs(names: str, quick: bool, seed: int) -> list[WorkloadSpec]:
    """The specs of a --suite value ("all" or comma-separated names), in the order given."""
    chosen = list(SUITE) if names.strip() == "all" else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SUITE]
    if unknown or not chosen:
        raise ValueError(f"--suite: unknown {unknown or 'none given'}; choose from "
                         f"{', '.join(SUITE)} or all")
    return [replace(SUITE[n][1 if quick else 0], seed=seed) for n in chosen]


def random_workload(spec: WorkloadSpec, token_range: tuple[int, int]) -> Workload:
    """Random token ids drawn from [low, high) — ids the tokenizer knows, so no engine trips on them."""
    rng = random.Random(spec.seed)
    low, high = token_range
    # The draws of a workload without a shared prefix come in the order they always did, so a
    # seed gives the same w64 requests as before the suite existed.
    lengths = [rng.randint(*spec.prompt_len) for _ in range(spec.num_requests)]
    prompts = [[rng.randrange(low, high) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randint(*spec.max_tokens) for _ in range(spec.num_requests)]
    prefix = [rng.randrange(low, high) for _ in range(spec.shared_prefix)]
    return Workload(prompts=[prefix + p for p in prompts], max_tokens=max_tokens,
                    description=spec.describe(), name=spec.name, n=spec.n,
                    temperature=spec.temperature, seed=spec.seed,
                    shared_prefix_len=spec.shared_prefix,
                    kv_bytes=None if spec.kv_mib is None else spec.kv_mib * 2**20)


def prompt_ids(record: dict, tokenizer, where: str) -> list[int]:
    """Token ids of one JSONL record: prompt_token_ids, prompt (text) or messages (chat)."""
    if "prompt_token_ids" in record:
        return list(record["prompt_token_ids"])
    if "prompt" in record:
        return tokenizer(record["prompt"])["input_ids"]
    if "messages" in record:
        return list(tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    raise ValueError(f"{where}: needs one of prompt_token_ids, prompt, messages")


def file_workload(path: Path, tokenizer, spec: WorkloadSpec) -> Workload:
    """Real prompts from a JSONL file; max_tokens from each record, else drawn like the random one."""
    rng = random.Random(spec.seed)
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    prompts, max_tokens = [], []
    for number, line in enumerate(lines[: spec.num_requests], start=1):
        record = json.loads(line)
        prompts.append(prompt_ids(record, tokenizer, f"{path}:{number}"))
        max_tokens.append(int(record.get("max_tokens") or rng.randint(*spec.max_tokens)))
    return Workload(prompts=prompts, max_tokens=max_tokens,
                    description=f"{len(prompts)} prompts from {path}, seed {spec.seed}",
                    name=path.stem, n=spec.n, temperature=spec.temperature, seed=spec.seed,
                    kv_bytes=None if spec.kv_mib is None else spec.kv_mib * 2**20)
