"""Pieces of the side-by-side benchmark (bench/bench_peers.py).

The run_*.py scripts are runners: each runs one engine in its own process and prints one JSON line
of results. They import only `common` (stdlib only) besides their engine, because the vLLM runner
runs under another Python (vLLM's own venv) where pagedgen is not installed.
"""
