"""Soak of --batch-invariant with the default model: mixed requests run with a roomy pool and
with a small one (many preemptions), then the small-pool run killed and resumed; counts the
requests whose output records are byte-identical across the runs.

Requests (seeded): prompts of 3..60 words, max_tokens 1..23, temperature 0 / 0.7 / 1.0 with a
seed per request, n 1..3, logprobs 1. Output records are compared on the ordered files.

    python bench/soak_batch_invariant.py --requests 200 --threads 1 --workdir /tmp/soak
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there would their we him been has when who "
         "will more no if out so said what up its about into than them can only other new some "
         "could time these two may then do first any my now such like our over man me even most "
         "made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "river garden engine paper winter market question history number silver kitchen").split()


def write_requests(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            temperature = rng.choice((0.0, 0.7, 1.0))
            record = {"id": i, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))),
                      "max_tokens": rng.randint(1, 23), "temperature": temperature,
                      "n": rng.randint(1, 3), "logprobs": 1}
            if temperature > 0:
                record["seed"] = rng.randrange(1 << 30)
            f.write(json.dumps(record) + "\n")


def run(inputs: Path, output: Path, args, num_blocks: int, extra=(), kill_after=None) -> str:
    command = [sys.executable, "-m", "pagedgen", "run", str(inputs), "--output", str(output),
               "--num-blocks", str(num_blocks), "--threads", str(args.threads), "-q",
               *extra] + (["--batch-invariant"] if not args.default_path else [])
    start = time.perf_counter()
    if kill_after is None:
        subprocess.run(command, check=True)
        return f"{time.perf_counter() - start:.0f} s"
    process = subprocess.Popen(command)
    time.sleep(kill_after)
    process.send_signal(signal.SIGINT)
    process.wait()
    done = sum(1 for _ in output.open()) if output.exists() else 0
    return f"killed after {kill_after} s with {done} records written"


def ordered(output: Path) -> dict:
    lines = output.with_suffix(".ordered.jsonl").read_text().splitlines()
    return {json.loads(line).get("id"): line for line in lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--roomy-blocks", type=int, default=300)
    parser.add_argument("--small-blocks", type=int, default=40)
    parser.add_argument("--kill-after", type=float, default=60.0)
    parser.add_argument("--default-path", action="store_true", help="without --batch-invariant")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pagedgen-soak"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    inputs = args.workdir / "requests.jsonl"
    write_requests(inputs, args.requests, seed=0)
    outs = {name: args.workdir / f"{name}.jsonl" for name in ("roomy", "small", "resumed")}
    for path in args.workdir.glob("*.jsonl"):
        if path != inputs:
            path.unlink()
    print("roomy pool:", run(inputs, outs["roomy"], args, args.roomy_blocks), flush=True)
    print("small pool:", run(inputs, outs["small"], args, args.small_blocks), flush=True)
    report = json.loads((args.workdir / "small.report" / "memory_report.json").read_text())
    print("small pool preemptions:", report["summary"]["preemptions"], flush=True)
    print("small pool, interrupted:", run(inputs, outs["resumed"], args, args.small_blocks,
                                          kill_after=args.kill_after), flush=True)
    print("small pool, resumed:", run(inputs, outs["resumed"], args, args.small_blocks,
                                      extra=("--resume",)), flush=True)
    roomy, small, resumed = (ordered(outs[name]) for name in ("roomy", "small", "resumed"))
    print(f"{'default path' if args.default_path else 'batch_invariant'}, {args.requests} "
          f"requests, threads {args.threads}: roomy vs small pool identical "
          f"{sum(roomy[i] == small.get(i) for i in roomy)}/{len(roomy)}; small vs killed+resumed "
          f"identical {sum(small[i] == resumed.get(i) for i in small)}/{len(small)}")


if __name__ == "__main__":
    main()
