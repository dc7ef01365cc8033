"""How long specbench takes to answer: the commands that decode nothing (--version, --help, list,
theory, compare) and refusals of bad options, each started as a user starts it, in a fresh
interpreter, timed from start to exit.

    python benchmarks/startup.py --repeats 5

Each command runs --repeats times (after one untimed run that warms the file cache); the table gives
the median and the slowest, in seconds, with the heavy libraries the command imported (from
``python -X importtime``) and its exit code, which for a refusal must be 2. compare compares the
committed CI baseline with itself. Run nothing else while it times.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = next((ROOT / "results" / "baselines").glob("*/*/summary.csv"), None)
HEAVY = ("torch", "transformers", "pandas", "numpy", "scipy", "vllm", "datasets", "matplotlib")
COMMANDS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "run --help": ["run", "--help"],
    "list": ["list"],
    "theory": ["theory", "--alpha", "0.9", "--c", "0.02"],
    "compare": ["compare", str(BASELINE), str(BASELINE)] if BASELINE else None,
    "refuse --k 1,,2": ["run", "--k", "1,,2"],
    "refuse --kv-budget 64": ["run", "--kv-budget", "64"],
    "refuse --method nope": ["run", "--method", "nope"],
    "refuse --temperature -1": ["run", "--temperature", "-1"],
    "refuse --engine server": ["run", "--engine", "server"],
}


def timed(args: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "specbench", *args], capture_output=True, cwd=ROOT)
    return time.perf_counter() - start, done.returncode


def heavy_imports(args: list[str]) -> list[str]:
    """The heavy libraries a command imports, as top-level modules in ``-X importtime``'s report."""
    report = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "specbench", *args], capture_output=True, text=True, cwd=ROOT
    ).stderr
    seen = {line.rsplit("|", 1)[-1].strip() for line in report.splitlines() if line.startswith("import time:")}
    return [name for name in HEAVY if name in seen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| command | median s | slowest s | exit | heavy imports |\n|---|---|---|---|---|")
    for name, command in COMMANDS.items():
        if command is None:
            print(f"| {name} | - | - | - | no committed baseline to compare |")
            continue
        timed(command)  # warm the file cache
        times, codes = zip(*(timed(command) for _ in range(args.repeats)), strict=True)
        heavy = ", ".join(heavy_imports(command)) or "none"
        print(f"| {name} | {statistics.median(times):.2f} | {max(times):.2f} | {codes[-1]} | {heavy} |", flush=True)


if __name__ == "__main__":
    main()
