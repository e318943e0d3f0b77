"""Ray, imported only when asked for; a session that starts a local instance or joins one."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

INSTALL_HINT = "pip install 'pagedgen[ray]'"


class RayUnavailable(ImportError):
    """Ray (with Ray Data) is not installed; the message says how to install it."""


def require_ray() -> ModuleType:
    try:
        import ray
        import ray.data  # noqa: F401 - the Data library is the part we need
    except ImportError as exc:
        raise RayUnavailable(f"running on Ray needs Ray Data ({exc}); install it with: "
                             f"{INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_session(address: str | None) -> Iterator[ModuleType]:
    """Joins `address` ('auto', 'ray://head:10001', 'host:6379') or, with None, starts a local
    instance on this machine; the caller's own session (ray.init done already) is reused and
    left running. Ray's own progress bars stay off: the caller reports progress."""
    ray = require_ray()
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=address, include_dashboard=False, configure_logging=True,
                 logging_level="warning", log_to_driver=True)
    logging.getLogger("ray.data").setLevel(logging.WARNING)   # no per-operator chatter
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    try:
        yield ray
    finally:
        if owned:
            ray.shutdown()
