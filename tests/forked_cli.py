"""`pagedgen` run in a process forked from a warm fork server (tests/test_run_interleavings.py).

A fresh interpreter spends seconds importing torch and transformers; a child forked from a
server that imported them once starts at once, so a test can start, kill and restart many
real processes. Only the import happens in the server (no torch thread pool exists yet, so
forking is safe); each child is a whole `pagedgen` process with its own signal handlers.

Two things differ from a real `pagedgen` process, and are mended here: a signal that lands while
multiprocessing itself starts the child ends it with status 1 (so the test waits for `ready`
before it signals), and an uncaught KeyboardInterrupt ends it with 1 where CPython would die
by SIGINT (so the child does what CPython does).
"""

import os
import signal
import sys


def main(argv: list[str], ready=None) -> None:
    """The `pagedgen` command line in this process; exits with its status."""
    from pagedgen.cli.app import app

    sys.argv = ["pagedgen", *argv]
    try:
        if ready is not None:
            ready.set()
        app(argv, prog_name="pagedgen")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


PRELOAD = ["forked_cli", "torch", "transformers", "pagedgen.cli.app", "pagedgen.jobs.run_job",
           "pagedgen.llm"]
