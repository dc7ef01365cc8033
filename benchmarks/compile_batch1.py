"""Does compiling pay at batch 1? One-token and (K+1)-token forwards of a model through each route of
specbench's loop, on this machine's device:

- eager: transformers' forward (--no-compile, the hf-* methods);
- own: specbench's forward, the modules' own weights;
- packed: specbench's forward, weights packed for oneDNN (a CPU's default route);
- inductor: specbench's forward with its elementwise work under torch.compile (CUDA's default route;
  on a CPU, packed weights as well when they can be).

    python benchmarks/compile_batch1.py --target smollm2-135m --tokens 1,5 --repeats 30

Every forward appends to a cache that holds a prompt of --context tokens and is cropped back after
each call, so each route times the same work. The routes take turns within each repeat (machine load
moves them alike); each figure is the median over repeats in ms. Building a route (packing, compiling
and warming) is timed once and reported apart: it happens at load, never inside a timed decode.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from specbench.decoding.timing import synchronize
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM
from specbench.models.load import load, resolve_device, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", default="1,5", help="forward sizes, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="tokens in the cache before each forward")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = resolve_device(args.device)
    loaded = load(args.target, device, resolve_dtype(args.dtype, device))
    model, width = loaded.model, loaded.width
    routes, built = {"eager": HFCausalLM(model, width)}, {"eager": 0.0}
    for name, options in (
        ("own", {"packed": False, "compiled": False}),
        ("packed", {"packed": True, "compiled": False}),
        ("inductor", {"packed": None, "compiled": True}),
    ):
        if name == "packed" and device.type != "cpu":
            continue
        fast = FastLlama(model, **options)
        if name == "inductor" and not fast.compiled:
            print("inductor: torch.compile failed here (see the log line above); not timed")
            continue
        routes[name], built[name] = HFCausalLM(model, width, fast=fast), fast.build_seconds
    sizes = [int(n) for n in args.tokens.split(",")]
    prompt = torch.arange(10, 10 + args.context, device=device) % width
    seconds = {(name, n): [] for name in routes for n in sizes}
    with torch.inference_mode():
        for lm in routes.values():
            lm.reset()
            lm.forward(prompt, last=1)
        for repeat in range(args.repeats + 2):  # the first two let each kernel and cache settle
            for name, lm in routes.items():
                for n in sizes:
                    ids = torch.arange(1, n + 1, device=device)
                    synchronize(device)
                    start = time.perf_counter()
                    lm.forward(ids, last=n)
                    synchronize(device)
                    if repeat >= 2:
                        seconds[(name, n)].append(time.perf_counter() - start)
                    lm.keep([], n)  # drop the n tokens again: the cache holds the prompt alone
    print(
        f"{args.target} on {device} ({model.dtype}), {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, context {args.context}, "
        f"median of {args.repeats}"
    )
    print("| route | build s | " + " | ".join(f"{n} token{'s' * (n > 1)} ms" for n in sizes) + " |")
    print("|---|---:|" + "---:|" * len(sizes))
    for name in routes:
        cells = [f"{1000 * statistics.median(seconds[(name, n)]):.1f}" for n in sizes]
        print(f"| {name} | {built[name]:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
