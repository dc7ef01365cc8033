"""pyproject's lower bounds for torch and transformers are tested ones: CI (.ci/run) runs `make
test-lowest`, the fast suite in an environment of exactly those versions, read from pyproject by
.ci/lowest-bounds. And whatever environment runs this suite satisfies pyproject's bounds."""

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parent.parent
FAST = 'pytest -q -m "not slow and not vllm and not llama_cpp"'


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {(r := Requirement(d)).name: r for d in project["dependencies"]}


def lower_bound(requirement: Requirement) -> str:
    [spec] = requirement.specifier  # one ">=" bound, so that the oldest allowed version is one version
    assert spec.operator == ">=", requirement
    return spec.version


def test_ci_runs_the_fast_suite_on_the_lowest_bounds(tmp_path):
    wanted = {name: lower_bound(requirements()[name]) for name in ("torch", "transformers")}
    pins = subprocess.run(
        [sys.executable, ROOT / ".ci" / "lowest-bounds"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert pins == [f"{name}=={bound}" for name, bound in sorted(wanted.items())]
    plan = subprocess.run(
        ["make", "-n", "test-lowest", f"LOWEST_ENV={tmp_path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert ".ci/lowest-bounds" in plan and f"{tmp_path}/bin/pip install -q $bounds" in plan
    assert f"{tmp_path}/bin/python -m {FAST}" in plan
    assert "\nstep make test-lowest " in (ROOT / ".ci" / "run").read_text()


def test_the_installed_torch_and_transformers_are_within_the_bounds():
    for name in ("torch", "transformers"):
        installed = Version(Version(version(name)).base_version)  # 2.13.0+cpu as 2.13.0
        assert installed in requirements()[name].specifier, f"{name} {installed} is outside pyproject's bounds"
