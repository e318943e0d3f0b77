"""The command-line job: the Typer app (`app.py`), the `run` job, `profile`, `inspect-memory`,
the YAML config, input records (JSONL and OpenAI batch lines), the output files, the checks of
every path a run writes (`paths.py`), the run manifest that `--resume` checks (`manifest.py`)
and the exit statuses (`exit_codes.py`).

The CLI sits on top of the facade (`pagedgen.llm.LLM`); nothing below it imports it.
"""
