"""The command-line job: the Typer app (`app.py`), the `run` job, `profile`, `inspect-memory`,
the YAML config, input records (JSONL and OpenAI batch lines) and the output files.

The CLI sits on top of the facade (`pagedgen.llm.LLM`); nothing below it imports it.
"""
