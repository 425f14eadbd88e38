"""What every ``eogp`` command group shares: clean failures and ``--json`` output."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import click

from eogp_index.errors import EOGPError


def fail_cleanly(func: Callable) -> Callable:
    """Turn library errors into ``click`` errors: a message and exit status 1, no traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except EOGPError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON, or hand it to ``human`` for a readable rendering."""
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)
