"""Usage mistakes (a bad flag value, a missing argument) as one clear line on
stderr and exit code 2, like every other mistake, instead of click's usage
block."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click


def _run(main: Any, args: Sequence[str] | None, prog_name: str | None, **extra: Any) -> NoReturn:
    try:
        rv = main(args, prog_name, standalone_mode=False, **extra)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)  # --help and --version return their exit code


class OneLineCommand(click.Command):
    """A command whose usage errors are one line."""

    # Click types main() as two overloads on standalone_mode; ours is always standalone.
    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> NoReturn:
        extra.pop("standalone_mode", None)
        _run(super().main, args, prog_name, **extra)


class OneLineGroup(click.Group):
    """A group whose usage errors (its own and its subcommands') are one line."""

    # Click types main() as two overloads on standalone_mode; ours is always standalone.
    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> NoReturn:
        extra.pop("standalone_mode", None)
        _run(super().main, args, prog_name, **extra)
