"""make gpu-wheels: the wheel folder that `make gpu-check WHEELS=DIR` installs from on an offline GPU machine.

    python -m benchmarks.gpu_wheels DIR

It holds specbench's dependencies that a stock CUDA PyTorch image lacks, with their own dependencies,
for CPython 3.11 to 3.13 on manylinux x86_64: each wheel is downloaded with pip (--no-deps, binary
only) and its Requires-Dist read, until nothing new is asked for. What the image holds (STOCK, with
what those packages need, as installed here) is left out, and so is pyarrow: 40-odd MB a Python
version, where the folder must stay small enough to travel with the checkout. An image without
pyarrow gets `datasets` installed but not importable, which gpu-check's steps do not need.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

from benchmarks.gpu_check import declared, normal

# What a stock CUDA PyTorch image holds (docs/results.md, On a GPU).
STOCK = (
    "torch transformers accelerate huggingface-hub safetensors tokenizers numpy pandas scipy typer rich "
    "matplotlib aiohttp prometheus-client pytest pytest-xdist"
).split()
TOO_BIG = {"pyarrow"}
PYTHONS = ("3.11", "3.12", "3.13")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)] + ["manylinux2014_x86_64"]
LIMIT = 8 * 2**20


def stock_closure() -> set[str]:
    """STOCK and everything those need, as far as this environment's metadata tells."""
    seen, queue = set(), [normal(n) for n in STOCK]
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        for text in needs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                queue.append(normal(req.name))
    return seen


def metadata(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def download(folder: Path, requirements: list[str], python: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation"]
    command += ["cp", "--python-version", python, *platforms, "-d", str(folder), *requirements]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        sys.exit(f"gpu-wheels: pip could not download {' '.join(requirements)} for Python {python}: {lines[-1]}")


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu-wheels")
    folder.mkdir(parents=True, exist_ok=True)
    skip = stock_closure() | TOO_BIG
    wanted = [Requirement(n) for n in declared() if normal(n) not in skip]
    fetched: set[str] = set()
    while wanted:
        level = {normal(r.name): r for r in wanted if normal(r.name) not in fetched}
        wanted = []
        if not level:
            break
        for python in PYTHONS:
            download(folder, [str(r) for r in level.values()], python)
            env = default_environment() | {"python_version": python, "python_full_version": f"{python}.0"}
            for wheel in folder.glob("*.whl"):
                if normal(wheel.name.split("-")[0]) not in level:
                    continue
                for req in metadata(wheel):
                    needed = req.marker is None or req.marker.evaluate(env | {"extra": ""})
                    if needed and normal(req.name) not in skip | fetched | set(level):
                        wanted.append(req)
        fetched |= set(level)
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{folder}: {len(wheels)} wheels, {total / 2**20:.1f} MiB ({', '.join(sorted(fetched))})")
    if total > LIMIT:
        sys.exit(
            f"gpu-wheels: {folder} holds {total / 2**20:.1f} MiB, over the {LIMIT / 2**20:.0f} MiB it must travel in"
        )


if __name__ == "__main__":
    main()
