"""The commands' setting flags, generated from the settings table (pagedgen/settings/table.py).

`@with_setting_flags("run")` adds one Typer option per setting the table gives that command:
its flag (`--block-size`; a yes/no setting as `--prefix-caching/--no-prefix-caching`), its help
text with the table's default shown, and its help panel. Every option defaults to None ("not
given": the config file's value, else the table's, stands); the command receives the given ones
as `setting_flags`, {flag: value}, for the config loader, which checks each by its table entry.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional

import typer

from pagedgen.settings import TABLE, Setting, for_command

# flag -> setting name, for turning given flags into config overrides
FLAG_TO_SETTING = {s.flag_name: s.name for s in TABLE}


def option(setting: Setting) -> Any:
    flag = setting.flag_name
    decls = f"{flag}/--no-{flag[2:]}" if setting.kind == "bool" else flag
    metavar = "|".join(setting.choices) if setting.choices else None
    return typer.Option(None, decls, help=setting.help, show_default=setting.shown_default,
                        rich_help_panel=setting.group, metavar=metavar)


def with_setting_flags(command: str, skip: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Adds the table's options for `command` (but those in `skip`, which the command declares
    in its own shape) to a command function that takes `setting_flags`."""
    settings = [s for s in for_command(command) if s.name not in skip]

    def wrap(func: Callable) -> Callable:
        signature = inspect.signature(func, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "setting_flags"]
        added = [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=option(s),
                                   annotation=Optional[s.flag_type]) for s in settings]

        @functools.wraps(func)
        def with_flags(*args: Any, **kwargs: Any) -> Any:
            given = {s.flag_name: kwargs.pop(s.name) for s in settings}
            return func(*args, setting_flags=given, **kwargs)

        with_flags.__signature__ = signature.replace(parameters=[*own, *added])
        return with_flags
    return wrap
