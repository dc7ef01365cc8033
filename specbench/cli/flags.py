"""Command-line flags built from the option declarations (core/options.py, and each method's own): the
Typer signature of `run`, `sweep-k`, `sweep-context` and `audit`, so that no flag is written twice."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from specbench.core.options import OUTPUT_PANEL, Option
from specbench.methods.registry import METHODS

SHORT = 20  # the widest value --help shows in its own column: longer choices are listed in the help text


def metavar(option: Option) -> str:
    """What --help shows for an option's value: its choices when they are short, else a word for its kind."""
    choices = "[" + "|".join(option.choices) + "]" if option.choices else ""
    for shown in (option.metavar, choices):
        if shown and len(shown) <= SHORT:
            return shown
    if option.metavar or option.choices or option.repeat:
        return "NAME"
    if option.parse is not None:
        return "LIST"
    return {int: "INT", float: "FLOAT"}.get(option.kind if option.default is None else type(option.default), "TEXT")


def help_of(option: Option) -> str:
    """An option's help, with the choices that --help's value column leaves out (NAME)."""
    text = option.help
    if option.choices and metavar(option) == "NAME" and not all(choice in text for choice in option.choices):
        text += f" One of: {', '.join(option.choices)}."
    return text


def parameter(option: Option, default=inspect.Parameter.empty) -> inspect.Parameter:
    """A Typer option built from a declaration: its flags, type, help, choices and default (or ``default``)."""
    if option.repeat is not None:
        kind = list[str] | None
    elif option.parse is not None:
        kind = str
    else:
        kind = option.type
    # A flag that is off by default is given alone (--random-weights), without a --no- form to list.
    names = option.flags or ((option.flag,) if kind is bool and option.default is False else ())
    shown = help_of(option)
    # Typer shows the defaults of the others, and a command's own default (``default``) of this one too
    if option.repeat is not None and option.default and default is inspect.Parameter.empty:
        shown += f" [default: {', '.join(option.default)}]"
    declared = typer.Option(
        *names,
        help=escape(shown),  # rich would read "[default: x]" as markup and drop it
        metavar="" if option.is_flag else metavar(option),
        rich_help_panel=panel_of(option),
    )
    default = option.text_default if default is inspect.Parameter.empty else default
    return inspect.Parameter(
        option.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, declared]
    )


def plain(name: str, kind: type, default, help: str) -> inspect.Parameter:
    """A Typer option of the output that is not a declaration of the run (--out, --resume, --wide)."""
    names = ("--" + name,) if kind is bool else ()
    declared = typer.Option(*names, help=help, rich_help_panel=OUTPUT_PANEL, metavar="" if kind is bool else "PATH")
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, declared]
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


# The command's click context, for what the flags cannot say: whether a value was given or defaulted.
CONTEXT = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=typer.Context)
RUN_OUT = plain(
    "out",
    Path | None,
    None,
    "Run directory (default results/<time>-<target>-<draft>/); one that holds a run is refused, unless --resume.",
)
RESUME = plain(
    "resume",
    bool,
    False,
    "Continue an interrupted run in --out with the same configuration: finished prompts are kept.",
)
WIDE = plain("wide", bool, False, "Show every column of the summary table (by default those that fit 100 columns).")
AUDIT_OUT = plain("out", Path | None, None, "Audit directory (default results/<time>-audit-<target>/).")


REFERENCE = "docs/options.md"  # every option of run, sweep-k, sweep-context and audit, written by reference()


def panel_of(option: Option) -> str:
    owners = [m.name for m in METHODS.values() if option in m.options]
    return option.panel or (f"Options of {', '.join(owners)}" if owners else "Options")


def reference(options, audit_options) -> str:
    """docs/options.md: the options of `run` (``options``) and then `audit`'s own (``audit_options``) in
    --help's panels, each with its value, default and help."""
    from specbench.bench.config import read_by

    outputs = [(p.name, p.annotation.__metadata__[0]) for p in (RUN_OUT, RESUME, WIDE)]
    rows: dict[str, list[str]] = {}
    for option in [*options, *audit_options]:
        default = ", ".join(map(str, option.default)) if isinstance(option.default, list) else option.default
        shown = "" if default in (None, "") else f"`{default}`"  # a list's is joined: empty when it is
        value = "" if option.is_flag else f"`{metavar(option)}`"
        readers = read_by(option.name) if option not in audit_options else ""
        text = (help_of(option) + (f" Read only by {readers}." if readers else "")).replace("|", "\\|")
        rows.setdefault(panel_of(option), []).append(f"| `{option.flag}` | {value} | {shown} | {text} |")
    for name, info in outputs:
        rows.setdefault(OUTPUT_PANEL, []).append(f"| `--{name}` | | | {info.help} |")
    lines = [
        "# Options",
        "",
        "Every option of `specbench run`, in the panels of `run --help`. `sweep-k` and `sweep-context` take the",
        "same options with other defaults (their `--help` says which); `specbench audit` takes them too, and the",
        "audit's own panel last. This page is written from the declarations (core/options.py and each method's in",
        "methods/registry.py) by `python -m specbench.cli.flags`; a test fails while it differs from them.",
        "",
        'An option that only some runs read says which ("Read only by"): the dataset, engine, method or command',
        "that reads it. Set for a run that has none of them, it is refused in one line before anything loads, as",
        "it would otherwise be ignored without a word (`--dataset-path` with `--dataset humaneval`).",
    ]
    for panel, panel_rows in rows.items():
        lines += [
            "",
            f"## {panel}",
            "",
            "| option | value | default | what it does |",
            "|---|---|---|---|",
            *panel_rows,
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from specbench.bench.config import OPTIONS
    from specbench.core.options import AUDIT

    Path(REFERENCE).write_text(reference(OPTIONS.values(), AUDIT))
    print(f"wrote {REFERENCE}")
