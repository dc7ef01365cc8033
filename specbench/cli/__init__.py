"""The command line: Typer commands and their flags, derived from the declarations."""
