"""Command-line flags built from the option declarations (core/options.py, and each method's own): the
Typer signature of `run`, `sweep-k`, `sweep-context` and `audit`, so that no flag is written twice."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from specbench.core.options import Option
from specbench.methods.registry import METHODS


def parameter(option: Option, default=inspect.Parameter.empty) -> inspect.Parameter:
    """A Typer option built from a declaration: its flags, type, help, choices and default (or ``default``)."""
    if option.repeat is not None:
        kind = list[str] | None
    elif option.parse is not None:
        kind = str
    else:
        kind = option.type
    owners = [m.name for m in METHODS.values() if option in m.options]
    metavar = option.metavar or ("[" + "|".join(option.choices) + "]" if option.choices else None)
    shown = f"{option.help} [default: {', '.join(option.default)}]" if option.repeat else option.help
    declared = typer.Option(
        *option.flags,
        help=shown,
        metavar=metavar,
        rich_help_panel=option.panel or (f"Options of {', '.join(owners)}" if owners else None),
    )
    default = option.text_default if default is inspect.Parameter.empty else default
    return inspect.Parameter(
        option.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, declared]
    )


def plain(name: str, kind: type, default, help: str) -> inspect.Parameter:
    """A Typer option that is not a declaration of the run (--out, --resume)."""
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, typer.Option(help=help)]
    )


def command(function: Callable, options, defaults: dict | None = None, extra: tuple = ()) -> Callable:
    """``function`` as a Typer command whose flags are ``options``' (with ``defaults`` overriding
    theirs), then ``extra``'s."""
    defaults = defaults or {}

    @functools.wraps(function)
    def wrapped(**given):
        return function(**given)

    params = [parameter(o, defaults.get(o.name, inspect.Parameter.empty)) for o in options]
    wrapped.__signature__ = inspect.Signature([*params, *extra])
    return wrapped


RUN_OUT = plain("out", Path | None, None, "Run directory (default results/<time>-<target>-<draft>/).")
RESUME = plain(
    "resume",
    bool,
    False,
    "Continue an interrupted run in --out with the same configuration: finished prompts are kept.",
)
WIDE = plain("wide", bool, False, "Show every column of the summary table (by default those that fit 100 columns).")
AUDIT_OUT = plain("out", Path | None, None, "Audit directory (default results/<time>-audit-<target>/).")
