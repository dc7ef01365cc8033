"""Writing files so that a reader never sees half of one, and a user's bad path is one line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specbench.core.errors import SpecbenchError


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it replaces ``path`` in one
    rename, so a reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """A report at a path the user chose: its directory is made, a failure is one line."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise SpecbenchError(f"cannot write {path} ({exc.strerror}); choose a writable path") from None
