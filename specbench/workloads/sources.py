"""Python source that is already on the machine: training text for drafts and long prompts."""

from __future__ import annotations

from pathlib import Path

from specbench.core.errors import SpecbenchError


def source_files(roots: list[str]) -> list[Path]:
    """Python files under ``roots``, minus installed third-party packages and test suites."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = []
    for root in roots:
        root_path = Path(root)
        if not root_path.exists():
            raise SpecbenchError(
                f"training source {root} does not exist: pass directories of text or code with --source"
            )
        candidates = [root_path] if root_path.is_file() else root_path.rglob("*.py")
        files += [p for p in candidates if not skip & set(p.relative_to(root_path).parts)]
    return sorted(files)
