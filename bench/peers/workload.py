"""The benchmark's workload: seeded random requests, or real prompts from a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from peers.common import Workload


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: tuple[int, int]      # inclusive range, uniform
    max_tokens: tuple[int, int]      # inclusive range, uniform
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name in ("prompt_len", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {low}..{high}")


FULL = WorkloadSpec(num_requests=64, prompt_len=(32, 512), max_tokens=(16, 256))
QUICK = WorkloadSpec(num_requests=6, prompt_len=(8, 48), max_tokens=(4, 12))


def random_workload(spec: WorkloadSpec, token_range: tuple[int, int]) -> Workload:
    """Random token ids drawn from [low, high) — ids the tokenizer knows, so no engine trips on them."""
    rng = random.Random(spec.seed)
    low, high = token_range
    lengths = [rng.randint(*spec.prompt_len) for _ in range(spec.num_requests)]
    prompts = [[rng.randrange(low, high) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randint(*spec.max_tokens) for _ in range(spec.num_requests)]
    description = (f"{spec.num_requests} requests, random token ids, prompt {spec.prompt_len[0]}.."
                   f"{spec.prompt_len[1]}, max_tokens {spec.max_tokens[0]}..{spec.max_tokens[1]}, "
                   f"seed {spec.seed}")
    return Workload(prompts=prompts, max_tokens=max_tokens, description=description)


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
                    description=f"{len(prompts)} prompts from {path}, seed {spec.seed}")
