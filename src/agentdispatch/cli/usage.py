"""Usage mistakes (a bad flag value, a missing argument) as one clear line on
stderr and exit code 2, like every other mistake, instead of click's usage
block."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click


def _main(
    self: click.Command, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
) -> NoReturn:
    """``click.Command.main``, always standalone, with usage errors as one line."""
    extra.pop("standalone_mode", None)
    try:
        rv = click.Command.main(self, args, prog_name, standalone_mode=False, **extra)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)  # --help and --version return their exit code


class OneLineCommand(click.Command):
    """A command whose usage errors are one line."""

    main = _main  # type: ignore[assignment]  # click types main() as overloads on standalone_mode


class OneLineGroup(click.Group):
    """A group whose usage errors (its own and its subcommands') are one line."""

    main = _main  # type: ignore[assignment]
