"""The prefix store on disk, side by side in one run: each workload runs in fresh processes
(start-up included: imports, model load) with the store off, cold (a fresh store) and warm
(the store the cold run left), on the default model. A run's place in the sequence moves its
wall by several percent on a shared machine, so the store-off run goes first in odd repeats and
last in even ones: use an even --repeats for the cold/off ratio.

Prints per run: total wall from process spawn to exit, start-up, generate wall, store hits,
bytes read/written, full blocks on disk at exit (of those the run computed), and bytes on disk
per token against the pool's; then warm/cold and cold/off ratios (medians over --repeats).
Whether the page cache was warm: the warm run reads files the cold run wrote seconds before,
so they are normally in the page cache (said in the output as "page cache: warm");
--drop-cache evicts them first (posix_fadvise DONTNEED on every block file).

    python bench/bench_prefix_store.py --threads 2 --scale 0.25 --workloads long,shared-prefix,small-job
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from cpu_info import cpu_info  # noqa: E402
from workload import SUITE, random_workload, scaled  # noqa: E402

BLOCK_SIZE = 16


def child(args: argparse.Namespace) -> None:
    """One run in this process: the workload with the given store; a JSON line on stdout."""
    spawn = float(args.spawn_time)
    import torch

    from pagedgen import LLM, SamplingParams
    from pagedgen.engine.prefix_store import block_keys
    from pagedgen.engine.store_identity import kernel_path

    spec = replace(scaled(SUITE[args.workload][0], args.scale), seed=0)
    llm = LLM(None, threads=args.threads, block_size=BLOCK_SIZE, kv_memory=int(args.kv_gib * 2**30),
              prefix_store=args.store or None, kv_cache_dtype=args.kv_cache_dtype)
    started, cpu_started = time.time(), time.process_time()
    vocab = llm.loaded.config.vocab_size
    work = random_workload(spec, (100, min(vocab, 40_000)))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in work.max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
    finished, cpu_finished = time.time(), time.process_time()
    result = {"startup_s": started - spawn, "generate_s": finished - started,
              "startup_cpu_s": cpu_started, "generate_cpu_s": cpu_finished - cpu_started,
              "prompt_tokens": sum(map(len, work.prompts)), "dtype": str(llm.runner.dtype),
              "threads": torch.get_num_threads(), "pool_bytes_per_token": llm.runner.kv_bytes_per_token,
              "kernel_path": kernel_path(llm.runner),
              "tokens": [o.outputs[0].token_ids for o in outputs]}
    if args.store:
        store = llm.engine.store.store
        root = llm.engine.kv.store.root
        keys = {k for p, o in zip(work.prompts, outputs)
                for k in block_keys(root, p + o.outputs[0].token_ids[:-1], BLOCK_SIZE,
                                    (len(p) + len(o.outputs[0].token_ids) - 1) // BLOCK_SIZE)}
        stats = store.stats()
        result.update(full_blocks=len(keys), on_disk=sum(store.contains(k) for k in keys),
                      store_files=stats.files, store_bytes=stats.bytes,
                      report=llm.memory_report()["prefix_store"])
    result["wall_s"] = time.time() - spawn
    result["cpu_s"] = time.process_time()  # all threads of this process, start-up included
    print("RESULT " + json.dumps(result), flush=True)


def one_run(workload: str, store: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--workload", workload, "--store", store,
               "--threads", str(args.threads), "--scale", str(args.scale), "--kv-gib", str(args.kv_gib),
               "--kv-cache-dtype", args.kv_cache_dtype, "--spawn-time", repr(time.time())]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the {workload} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    result["wall_s"] = max(result["wall_s"], 0.0)
    return result


def drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _same(a: list, b: list) -> str:
    """"k/n": how many of the n sequences have the same tokens in both runs. Only the
    batch-invariant mode promises all n: without it, a sequence's batch neighbours differ between
    a cold run (decodes beside other prompts' prefill) and a warm one, and a near-tie of two
    tokens can go the other way."""
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def bench(workload: str, args: argparse.Namespace, stores: Path) -> dict:
    rows = {"off": [], "cold": [], "warm": []}
    for repeat in range(args.repeats):
        store = str(stores / f"{workload}-{repeat}")
        if repeat % 2 == 0:
            rows["off"].append(one_run(workload, "", args))
        rows["cold"].append(one_run(workload, store, args))
        if args.drop_cache:
            drop_page_cache(Path(store))
        rows["warm"].append(one_run(workload, store, args))
        if repeat % 2 == 1:
            rows["off"].append(one_run(workload, "", args))
        for mode, runs in rows.items():
            r = runs[-1]
            extra = ""
            if "report" in r:
                rep = r["report"]
                extra = (f" hits {rep['hit_blocks']} blocks, read {rep['bytes_read'] / 2**20:.1f} MiB, "
                         f"written {rep['bytes_written'] / 2**20:.1f} MiB, full blocks on disk "
                         f"{r['on_disk']}/{r['full_blocks']}, disk bytes/token "
                         f"{r['store_bytes'] / (r['store_files'] * BLOCK_SIZE):.0f} vs pool "
                         f"{r['pool_bytes_per_token']}")
            print(f"  {workload} #{repeat + 1} {mode:4s}: wall {r['wall_s']:.1f} s (start-up "
                  f"{r['startup_s']:.1f}, generate {r['generate_s']:.1f}), CPU {r['cpu_s']:.1f} s "
                  f"(generate {r['generate_cpu_s']:.1f}){extra}", flush=True)
        off, cold, warm = (rows[m][-1]["tokens"] for m in ("off", "cold", "warm"))
        print(f"  {workload} #{repeat + 1}: greedy sequences identical off/cold "
              f"{_same(off, cold)}, cold/warm {_same(cold, warm)}; "
              f"kernels: {rows['cold'][-1]['kernel_path']}", flush=True)
    median = {m: statistics.median(r["wall_s"] for r in runs) for m, runs in rows.items()}
    cpu = {m: statistics.median(r["cpu_s"] for r in runs) for m, runs in rows.items()}
    cold = rows["cold"][-1]
    summary = {"workload": workload, "median_wall_s": median,
               "warm_over_cold": median["warm"] / median["cold"],
               "cold_over_off": median["cold"] / median["off"],
               "median_cpu_s": cpu, "warm_over_cold_cpu": cpu["warm"] / cpu["cold"],
               "cold_over_off_cpu": cpu["cold"] / cpu["off"],
               "full_blocks_on_disk": f"{cold['on_disk']}/{cold['full_blocks']}",
               "disk_over_pool_bytes_per_token":
                   cold["store_bytes"] / (cold["store_files"] * BLOCK_SIZE) / cold["pool_bytes_per_token"],
               "prompt_tokens": cold["prompt_tokens"], "dtype": cold["dtype"], "threads": cold["threads"],
               "page_cache": "dropped before warm" if args.drop_cache else "warm"}
    print(json.dumps(summary, indent=2), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="long,shared-prefix,small-job")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--drop-cache", action="store_true")
    parser.add_argument("--tmp", default=None, help="where the stores go (default: the system's)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spawn-time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"{time.strftime('%Y-%m-%d %H:%M')} threads {args.threads}, scale {args.scale}, "
          f"kv {args.kv_cache_dtype}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
          f"{cpu_info().summary()}", flush=True)
    # The stores are deleted at the end, not between runs: a cold run that starts just after
    # thousands of files were deleted pays for it in ext4's inode allocator (it skips inodes
    # freed in the last half minute, one lookup each), several percent of the run.
    stores = Path(tempfile.mkdtemp(prefix="pagedgen-store-bench-", dir=args.tmp))
    try:
        results = [bench(w.strip(), args, stores) for w in args.workloads.split(",") if w.strip()]
    finally:
        shutil.rmtree(stores, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
