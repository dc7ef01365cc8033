"""Does the row plan a CPU's forward measures at load pay? Forwards of 1 to --rows tokens of a model on
specbench's default CPU forward (packed, or left unpacked where the packed copy does not fit) under
the plan it measured at load (models/fast.row_plan), with every count as it comes (packed where there
is a copy), and with every count on the modules' own weights, in turns.

    python -m benchmarks.row_plan --repeats 9                                       # SmolLM2-135M
    python -m benchmarks.row_plan --target smollm2-135m-draft
    python -m benchmarks.row_plan --target llama-7b --random-weights --rows 2

The cache holds a prompt of --context tokens; each forward is cropped back after it, so every plan
times the same work. Each figure is the median over repeats, in ms, the first repeat dropped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specbench.core.machine import machine
from specbench.models.fast import PLANNED_UP_TO, FastLlama, Rows
from specbench.models.lm import HFCausalLM
from specbench.models.load import Wanted, load, random_model, random_weights_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--random-weights", action="store_true", help="the architecture with random weights")
    parser.add_argument("--context", type=int, default=187, help="tokens in the cache before each forward")
    parser.add_argument(
        "--rows", type=int, default=5, choices=range(1, PLANNED_UP_TO + 1), help="forwards of 1 to this many tokens"
    )
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    if args.random_weights:
        loaded = random_model(args.target, cpu, random_weights_dtype_for(args.target))
    else:
        loaded = load(args.target, cpu, torch.float32)
    fast = FastLlama(loaded.model)
    measured = dict(fast.plan)
    lm = HFCausalLM(loaded.model, loaded.width, None, fast)
    plans = {"measured": measured, "as they come": {}}
    if fast.packed:
        plans["own weights"] = {n: Rows(n, False) for n in measured}
    sizes = range(1, args.rows + 1)
    times = {(name, n): [] for name in plans for n in sizes}
    with torch.inference_mode():
        lm.reset()
        lm.forward(torch.arange(args.context) % loaded.width, last=1)
        for _ in range(args.repeats + 1):
            for name, plan in plans.items():
                fast.plan.clear()
                fast.plan.update(plan)
                for n in sizes:
                    start = time.perf_counter()
                    lm.forward(torch.arange(5, 5 + n), last=n)
                    times[name, n].append(time.perf_counter() - start)
                    lm.keep([], n)  # the tokens dropped: back to the prompt
    print(
        f"{args.target} ({loaded.model.dtype}, route {fast.route}) on {machine(None)['cpu']}, "
        f"{torch.get_num_threads()} threads; plan measured at load: "
        + (", ".join(f"{n}: {how}" for n, how in measured.items()) or "none (not a CPU route that plans)")
    )
    print("ms a forward of n tokens: " + " | ".join(f"n = {n}" for n in sizes))
    for name in plans:
        print(f"  {name}: " + " | ".join(f"{1e3 * statistics.median(times[name, n][1:]):.1f}" for n in sizes))


def random_weights_dtype_for(target: str) -> torch.dtype:
    """The dtype a run with --random-weights --dtype auto gives ``target`` on this CPU."""
    return random_weights_dtype(Wanted(target, None, random_weights=True), torch.device("cpu"))


if __name__ == "__main__":
    main()
