"""What a forward of n tokens costs in llama.cpp and in specbench's loop, on the same weights, and
where specbench's one-token forward spends its time.

    python benchmarks/beside_llama_cpp.py --gguf F32.gguf --gguf Q4_1.gguf --tokens 1,2,3,4,5

llama.cpp: a llama-server per GGUF file (the build `make install-llama-cpp` made) is sent a
prompt of --context random tokens once, then, per repeat and size n, that prompt followed by n new
random tokens and max_tokens 1: the server finds the prompt in its slot and evaluates only the n new
ones, which its response's timings.prompt_n and prompt_ms report (the forward alone, as llama.cpp
times it, without HTTP); then a greedy answer of --decode tokens, timed per token by llama.cpp
(timings.predicted_per_token_ms). specbench: the target's forward on the packed route with the same
cache length, timed around the call, and a greedy decode of --decode tokens (forward and argmax),
half the repeats before the servers start and half after they stop; then torch's profiler over
one-token forwards, its time split into the matrix products (the packed linear layers and the
head) and everything else.

Each figure is the median over --repeats in ms; the llama.cpp servers take turns within each repeat.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from specbench.engines import llamacpp
from specbench.engines.launch import launched
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM
from specbench.models.load import load


def llama_forward_ms(url: str, context: list[int], n: int, vocab: int, rng: random.Random, cached=True) -> float:
    """llama.cpp's time for a forward of ``n`` new tokens after ``context`` (already in its slot
    unless ``cached`` is False)."""
    body = {"prompt": context + [rng.randrange(100, vocab) for _ in range(n)], "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        timings = json.loads(response.read())["timings"]
    if cached and timings["prompt_n"] != n:
        raise RuntimeError(f"llama.cpp evaluated {timings['prompt_n']} tokens, not {n}: its prompt cache missed")
    return timings["prompt_ms"]


def profile_one_token(lm: HFCausalLM, width: int, forwards: int) -> tuple[float, float]:
    """Per one-token forward: the ms in matrix products, and in everything else (profiler self times)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            lm.forward(torch.tensor([7]), last=1)
            lm.keep([], 1)
    products = other = 0.0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / forwards
        if any(key in event.key for key in ("linear", "mm", "matmul", "mkldnn", "onednn", "packed")):
            products += ms
        else:
            other += ms
    return products, other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--gguf", action="append", default=[], help="a GGUF file of the target (repeatable)")
    parser.add_argument("--tokens", default="1,2,3,4,5")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--decode", type=int, default=64, help="tokens of each greedy decode timed")
    args = parser.parse_args()
    sizes = [int(n) for n in args.tokens.split(",")]
    server = llamacpp.find_server()
    loaded = load(args.target, torch.device("cpu"), torch.float32)
    width = loaded.width
    lm = HFCausalLM(loaded.model, width, fast=FastLlama(loaded.model))
    rng = random.Random(0)
    context = [rng.randrange(100, width) for _ in range(args.context)]
    times: dict[tuple[str, int | str], list[float]] = {}
    with tempfile.TemporaryDirectory() as logs, torch.inference_mode():
        lm.reset()
        lm.forward(torch.tensor(context), last=1)
        # specbench is timed while no llama-server runs, before and after them: after a request
        # llama.cpp's threads poll for work a while, and torch's threads timed beside them lost a
        # third of their speed.
        time_specbench(lm, sizes, args.repeats // 2, args.decode, width, rng, times)
        urls, stack = {}, []
        for path in args.gguf:
            # Two slots: with one, llama-server shares its cache across slots and clears the idle
            # slot on each new request, so the prompt would be evaluated again every time.
            command = llamacpp.command(server, Path(path), 2, args.context + args.decode + 64)
            manager = launched(Path(path).stem, command, Path(logs), who=f"llama-server {Path(path).name}")
            urls[f"llama.cpp {Path(path).stem}"] = manager.__enter__()
            stack.append(manager)
        try:
            for url in urls.values():  # the prompt into each slot, untimed
                llama_forward_ms(url, context, 1, width, rng, cached=False)
            for repeat in range(args.repeats + 2):
                for n in sizes:
                    for name, url in urls.items():
                        ms = llama_forward_ms(url, context, n, width, rng)
                        if repeat >= 2:  # the first two let each kernel and cache settle
                            times.setdefault((name, n), []).append(ms)
                for name, url in urls.items():
                    ms = llama_decode_ms(url, context, args.decode)
                    if repeat >= 2:
                        times.setdefault((name, "decode"), []).append(ms)
        finally:
            for manager in reversed(stack):
                manager.__exit__(None, None, None)
        time_specbench(lm, sizes, args.repeats - args.repeats // 2, args.decode, width, rng, times)
        products, other = profile_one_token(lm, width, args.repeats)
    print(f"{args.target}, context {args.context}, {torch.get_num_threads()} torch threads, median of {args.repeats}")
    print(
        "| engine | "
        + " | ".join(f"{n} token{'s' * (n > 1)} ms" for n in sizes)
        + " | n tokens / 1 token | greedy decode, ms per token |"
    )
    print("|---|" + "---|" * (len(sizes) + 2))
    for name in [*urls, SPECBENCH]:
        medians = [statistics.median(times[(name, n)]) for n in sizes]
        ratios = " / ".join(f"{m / medians[0]:.2f}" for m in medians[1:])
        decode = statistics.median(times[(name, "decode")])
        print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in medians) + f" | {ratios} | {decode:.2f} |")
    print(f"specbench one-token forward under the profiler: {products:.2f} ms in matrix products, {other:.2f} ms else")


SPECBENCH = "specbench packed f32"


def llama_decode_ms(url: str, context: list[int], tokens: int) -> float:
    """llama.cpp's time per token of a greedy answer of ``tokens`` after ``context`` (its own count:
    timings.predicted_per_token_ms, the forwards and sampling without HTTP)."""
    body = {"prompt": context, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        timings = json.loads(response.read())["timings"]
    return timings["predicted_per_token_ms"]


def time_specbench(lm, sizes, repeats, decode, width, rng, times) -> None:
    """specbench's forward of n new tokens after the context, and a greedy decode of ``decode``
    tokens (a forward and an argmax each, read once at the end, as the baseline reads every 8)."""
    for repeat in range(repeats + 2):
        for n in sizes:
            ids = torch.tensor([rng.randrange(100, width) for _ in range(n)])
            start = time.perf_counter()
            lm.forward(ids, last=n)
            elapsed = 1000 * (time.perf_counter() - start)
            lm.keep([], n)
            if repeat >= 2:
                times.setdefault((SPECBENCH, n), []).append(elapsed)
        token = torch.tensor([rng.randrange(100, width)])
        start = time.perf_counter()
        for _ in range(decode):
            token = lm.forward(token, last=1)[-1].argmax().reshape(1)
        token.item()
        elapsed = 1000 * (time.perf_counter() - start) / decode
        lm.keep([], decode)
        if repeat >= 2:
            times.setdefault((SPECBENCH, "decode"), []).append(elapsed)


if __name__ == "__main__":
    main()
