"""The batch job that `pagedgen run` and the Ray Data stage both run: the run config (YAML +
flags, `config.py`), input records (JSONL and OpenAI batch lines), request preparation, the job
loop (`run_job.py`), the output files, the checks of every path a run writes (`paths.py`) and the
run manifest that `--resume` checks (`manifest.py`).

It sits on the facade (`pagedgen.llm.LLM`); the CLI and `ray_data/` sit on it, nothing below
imports it.
"""
