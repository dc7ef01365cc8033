"""Does padding a CPU's products to the row count measured at load pay? One-token forwards of a
model on specbench's default CPU forward (packed, or left unpacked where the packed copy does not fit),
with the row counts it measured at load (models/fast.padded_rows) and with none, in turns.

    python -m benchmarks.row_padding --target llama-7b --random-weights --repeats 9

The cache holds a prompt of --context tokens; each forward is cropped back after it, so both settings
time the same work. Each figure is the median over repeats, in ms, the first repeat dropped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specbench.core.machine import machine
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM
from specbench.models.load import Wanted, load, random_model, random_weights_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--random-weights", action="store_true", help="the architecture with random weights")
    parser.add_argument("--context", type=int, default=187, help="tokens in the cache before each forward")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    if args.random_weights:
        loaded = random_model(args.target, cpu, random_weights_dtype_for(args.target))
    else:
        loaded = load(args.target, cpu, torch.float32)
    fast = FastLlama(loaded.model)
    measured = dict(fast.padding)
    lm = HFCausalLM(loaded.model, loaded.width, None, fast)
    settings = {"measured": measured, "none": {}}
    times = {name: [] for name in settings}
    with torch.inference_mode():
        lm.reset()
        lm.forward(torch.arange(args.context) % loaded.width, last=1)
        for _ in range(args.repeats + 1):
            for name, padding in settings.items():
                fast.padding.clear()
                fast.padding.update(padding)
                start = time.perf_counter()
                lm.forward(torch.tensor([5]), last=1)
                times[name].append(time.perf_counter() - start)
                lm.keep([], 1)  # the token dropped: back to the prompt
    print(
        f"{args.target} ({loaded.model.dtype}, route {fast.route}) on {machine(None)['cpu']}, "
        f"{torch.get_num_threads()} threads; row counts measured at load: {measured or 'none (not a CPU route that pads)'}"
    )
    for name, seconds in times.items():
        print(f"  padding {name}: one-token forward {1e3 * statistics.median(seconds[1:]):.1f} ms")


def random_weights_dtype_for(target: str) -> torch.dtype:
    """The dtype a run with --random-weights --dtype auto gives ``target`` on this CPU."""
    return random_weights_dtype(Wanted(target, None, random_weights=True), torch.device("cpu"))


if __name__ == "__main__":
    main()
