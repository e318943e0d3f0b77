"""The kernel backend seen through a phase timer: the attention entry points run inside
`hook.phase("attention")`, everything else passes through untouched.

The runner swaps this in only while someone (`pagedgen profile`) asked for phase timings, so a
normal run calls the backend directly and pays nothing.
"""

from __future__ import annotations

from typing import Any, Callable

ATTENTION_OPS = ("store_kv", "paged_attention", "plan_attention")


class TimedKernels:
    def __init__(self, kernels: Any, hook: Any) -> None:
        self._kernels, self._hook = kernels, hook

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._kernels, name)
        return self._timed(value) if name in ATTENTION_OPS else value

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._hook.phase("attention"):
                return fn(*args, **kwargs)
        return timed
