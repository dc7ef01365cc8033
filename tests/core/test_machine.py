import shutil
import subprocess

import pytest

from specbench.core.machine import source_revision

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(where, *args):
    return subprocess.run(["git", *args], cwd=where, check=True, capture_output=True, text=True).stdout.strip()


def test_the_revision_names_the_commit_and_counts_the_tracked_files_changed_since(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    git(repo, "init", "-q")
    for name in ("a.py", "b.py"):
        (repo / "pkg" / name).write_text("x = 1\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD")

    assert source_revision(repo / "pkg") == (head, 0)
    (repo / "pkg" / "new.py").write_text("untracked, not the commit's code: git status says so, not this count\n")
    assert source_revision(repo / "pkg") == (head, 0)
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    (repo / "pkg" / "b.py").unlink()
    assert source_revision(repo / "pkg") == (head, 2)


def test_outside_a_checkout_the_revision_is_unknown(tmp_path):
    assert source_revision(tmp_path) == (None, None)
