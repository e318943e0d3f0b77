"""The command line: the Typer app (`app.py`) and its commands `run` (the job itself lives in
`pagedgen.jobs`), `profile`, `inspect-memory`, the Ray launcher (`ray_job.py`) and the exit
statuses (`exit_codes.py`). Nothing imports the CLI.
"""
