"""vLLM beside pagedgen in a benchmark driver: its own venv, its own process, one JSON result.

The driver keeps pagedgen in its own process and runs a vLLM runner script (bench/peers/run_vllm_*.py)
with the Python of vLLM's venv, through `launch` (so a hung or crashed vLLM never takes the driver
down, and its workers end with it). Where vLLM is not installed the peer is skipped with a hint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from peers.install_vllm import DEFAULT_VENV, is_installed, venv_python
from peers.launch import launch

PEERS_DIR = Path(__file__).resolve().parent


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM peer")
    group.add_argument("--no-vllm", action="store_true", help="skip vLLM even where it is installed")
    group.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV,
                       help="vLLM's own virtual env (python bench/peers/install_vllm.py)")
    group.add_argument("--vllm-eager", action="store_true", help="run vLLM with enforce_eager")
    group.add_argument("--vllm-kv-gib", type=float, default=2.0, help="vLLM's KV cache budget, GiB")
    group.add_argument("--vllm-timeout", type=float, default=3600.0, help="seconds")
    group.add_argument("--work-dir", type=Path, default=None,
                       help="vLLM's workload, log and outputs (default: a temp dir)")


def vllm_wanted(args: argparse.Namespace) -> bool:
    """True when vLLM should run; prints why not otherwise."""
    if args.no_vllm:
        return False
    if not is_installed(args.vllm_venv):
        print(f"vLLM: skipped, not installed in {args.vllm_venv} "
              f"(python bench/peers/install_vllm.py --venv {args.vllm_venv})", flush=True)
        return False
    return True


def work_dir(args: argparse.Namespace) -> Path:
    if args.work_dir is None:
        args.work_dir = Path(tempfile.mkdtemp(prefix="pagedgen-vllm-"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    return args.work_dir


def run_vllm(script: str, runner_args: list[str], args: argparse.Namespace) -> dict | None:
    """Run bench/peers/`script` under vLLM's Python; its result line, or None (reason printed)."""
    folder = work_dir(args)
    command = [str(venv_python(args.vllm_venv)), str(PEERS_DIR / script), *runner_args,
               "--tokens-out", str(folder / "vllm.tokens.json"), "--kv-gib", str(args.vllm_kv_gib)]
    if args.vllm_eager:
        command.append("--eager")
    # A fresh cache root per run: vLLM's start-up (torch.compile) is a cold one, the same every time.
    env = {**os.environ, "VLLM_CACHE_ROOT": str(folder / "vllm-cache")}
    print(f"running vLLM ({script}; log {folder / 'vllm.log'}) ...", flush=True)
    run = launch("vllm", command, folder, args.vllm_timeout, env)
    if run.status != "ok":
        print(f"vLLM: failed ({run.reason}); see {run.log}", flush=True)
        return None
    return {**run.result, "wall_s": run.wall_s, "peak_tree_bytes": run.peak_tree_bytes}
