"""A real signal to this process in the middle of a run (for the runs' interruption tests)."""

from __future__ import annotations

import os

import pagedgen.jobs.run_job as run_job


def signal_after_results(monkeypatch, count: int, signum: int):
    """Sends `signum` to this process as the count-th result is being recorded, so that it
    lands mid-write; returns the real recorder, to put back before the run is resumed."""
    real_record, written = run_job.result_record, []

    def record_then_signal(result):
        written.append(result)
        if len(written) == count:
            os.kill(os.getpid(), signum)
        return real_record(result)
    monkeypatch.setattr(run_job, "result_record", record_then_signal)
    return real_record
