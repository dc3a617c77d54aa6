"""How `wmo-trio --help` names what each option takes.

typer shows every option's Python type (`<bool>` beside a flag that takes no value,
`<list[Path]>` beside a repeatable path). Each command and group of the CLI is built with the
classes below, which name values the way Unix tools do: a flag shows nothing, a value shows
what it is in capitals (`PATH`, `INTEGER`, `TEXT`, `NUMBER`), an argument its own name
in capitals.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

_VALUE_NAMES = {"int": "INTEGER", "float": "NUMBER", "str": "TEXT", "path": "PATH",
                "Path": "PATH"}


def name_values(params: list[Any], ctx: Any) -> None:
    """Give each parameter without a metavar the one `--help` should show."""
    for param in params:
        if param.metavar is not None:
            continue
        if isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""
        elif isinstance(param, TyperArgument):
            # Its name says what it takes; typer would add the type beside it (`PATH <path>`).
            param.metavar = str(param.name).upper()
            setattr(param, "display_type_rich", _no_type)  # noqa: B010 (an instance's own)
        elif isinstance(param, TyperOption):
            shown = param.display_type(ctx).strip("<>").removeprefix("list[").removesuffix("]")
            param.metavar = _VALUE_NAMES.get(shown, shown.upper())


def _no_type(ctx: Any) -> None:
    return None


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)
        name_values(params, ctx)
        return params


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)
        name_values(params, ctx)
        return params
