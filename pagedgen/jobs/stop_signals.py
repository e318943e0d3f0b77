"""What ends a run rather than one line: the signals and exceptions that stop the job."""

from __future__ import annotations


class JobInterrupted(BaseException):
    """SIGINT/SIGTERM. A BaseException, like KeyboardInterrupt, so that the handlers that turn
    one line's failure into its error record never swallow it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def is_stop(exc: BaseException) -> bool:
    """Exceptions that end the run, never one line (pyo3's PanicException, also a
    BaseException, is a tokenizer's failure on one input and so is not among them)."""
    return isinstance(exc, (JobInterrupted, KeyboardInterrupt, SystemExit, GeneratorExit))
