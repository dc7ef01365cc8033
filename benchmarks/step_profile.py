"""Where a step of the static path goes, model by model: the CUDA graph's replay alone, the kernels in
it, the forward as the decode loop calls it, the same forward timed as verify_cost.csv times it, and
a draft step as the loop drafts (its sampling outside the graph included).

issue 72's goals are end-to-end figures (the baseline's bandwidth utilisation, c); when one is missed
they do not say where the time went. This splits it:

- replay: back-to-back replays of the one-token graph, nothing else: the GPU's time for the step, the
  floor of what the loop can reach with this forward (its kernels, and the gaps between them);
- kernels: what the profiler saw inside a replay, by kernel: how many, their summed time (the replay's
  time less this is the gaps), the largest;
- loop: ``forward`` then ``keep`` back to back, as a decode's steps run (the host's copies, the replay
  and the output's copy; no wait between steps);
- synced: the same call with the device synchronised before and after, as models/costs.py measures
  the c and verify ratios that a run reports;
- host: the host's time to issue that call into an idle queue;
- drafted: a draft model's chain of K tokens as drafters/model.ModelDrafter proposes it, per token,
  greedy and sampled.

    python -m benchmarks.step_profile --target llama-7b --draft llama-68m --dtype bfloat16   # a GPU
    python -m benchmarks.step_profile --dry     # a toy pair on the CPU (the static path compiled, no graphs)

Random weights (costs do not depend on them). Writes step-profile.md and step-profile.json to --out;
make gpu-check runs it as its step f.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specbench.decoding.sampling import Sampling
from specbench.decoding.timing import synchronize
from specbench.drafters.model import ModelDrafter
from specbench.models.costs import copy_bandwidth, streamed_bytes
from specbench.models.load import random_model
from specbench.models.static import StaticLM

TOP_KERNELS = 8  # kernels listed per model


def per_call_us(device: torch.device, fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn`` run ``calls`` times back to back (the device synchronised around
    the batch, not between calls): the median over ``repeats`` batches."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(times)


def synced_us(device: torch.device, fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The median microseconds of one call of ``fn`` with the device synchronised before and after (as
    models/costs.py times a forward), and of the host's part alone: issuing it into an idle queue."""
    whole, host = [], []
    for _ in range(repeats):
        synchronize(device)
        began = time.perf_counter()
        fn()
        issued = time.perf_counter()
        synchronize(device)
        whole.append((time.perf_counter() - began) * 1e6)
        host.append((issued - began) * 1e6)
    return statistics.median(whole), statistics.median(host)


def kernels(device: torch.device, fn: Callable[[], object], calls: int) -> list[dict]:
    """What the profiler saw over ``calls`` calls of ``fn``, per call: on CUDA each kernel's count and
    microseconds of device time; on a CPU each operation's own time (the dry run's stand-in)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    rows = []
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": event.key, "count": event.count / calls, "us": us / calls})
    return sorted(rows, key=lambda r: -r["us"])


def static_lm(spec: str, device: torch.device, dtype: torch.dtype, seed: int, tokens: int, widest: int) -> StaticLM:
    """``spec`` with random weights on the static path, its cache reserved for ``tokens`` and its
    forwards compiled (and on CUDA captured) up to ``widest`` + 2 tokens, as a run reserves them."""
    loaded = random_model(spec, device, dtype, seed=seed)
    lm = StaticLM.of(loaded.model, loaded.width, compiled=True)
    lm.reserve(tokens, widest)
    return lm


def profile_model(lm: StaticLM, prompt: torch.Tensor, sizes: tuple[int, ...], repeats: int, calls: int) -> dict:
    """The figures of one model, its cache holding ``prompt``: for each forward size in ``sizes``, the
    replay alone (CUDA), the loop's call, the synced call and the host's part; and the kernels of a
    one-token replay."""
    device = lm.device
    lm.reset()
    lm.forward(prompt)  # the prompt, uncompiled, as a sequence's first forward runs
    weights, kv_per_token = streamed_bytes(lm.model)
    figures = {
        "route": lm.route,
        "weight_bytes": weights,
        "cache_bytes": kv_per_token * lm.kv.capacity,  # a step attends over the whole buffer, masked
        "cache_positions": lm.kv.capacity,
        "sizes": {},
    }
    for n in sizes:
        ids = prompt[:n].clone()

        def forward(ids=ids, n=n):
            lm.forward(ids, last=1)
            lm.keep([], n)

        forward()  # any first call's work (a shape's compile) stays out
        graph = lm.graphs.get((n, None))
        row = {
            "replay_us": per_call_us(device, graph.replay, calls, repeats) if graph is not None else None,
            "loop_us": per_call_us(device, forward, calls, repeats),
        }
        row["synced_us"], row["host_us"] = synced_us(device, forward, repeats * calls)
        if n == 1:
            one = graph.replay if graph is not None else forward
            figures["kernels"] = kernels(device, one, calls)
        figures["sizes"][n] = row
    return figures


def drafted_us(
    lm: StaticLM, prompt: torch.Tensor, k: int, temperature: float, chained: bool, repeats: int, calls: int
) -> float:
    """Microseconds per drafted token of ``lm`` drafting chains of ``k`` as ModelDrafter does (no host
    read): ``chained``, each chain's forwards and draws as one graph where the model can
    (StaticLM.draft_chain), else a forward and a draw at a time; each chain dropped again so the next
    drafts from the same place."""
    sampling, generator = Sampling(temperature=temperature), torch.Generator(lm.device).manual_seed(0)
    lm.chaining = chained
    lm.reset()
    drafter = ModelDrafter(lm, sampling, generator)
    drafter.start(prompt[:-1], prompt[-1:])
    read, pending = lm.length, drafter.pending

    def chain():
        drafter.propose(k)
        lm.keep([], lm.length - read)
        drafter.pending = pending

    chain()
    return per_call_us(lm.device, chain, calls, repeats) / k


def measure(
    target: str, draft: str, device: torch.device, dtype: torch.dtype, prompt_tokens: int, new_tokens: int, k: int
) -> dict:
    """Every figure of the module docstring for the ``target`` and ``draft`` specs."""
    tokens = prompt_tokens + new_tokens + k + 1  # what a run of these sizes reserves
    began = time.perf_counter()
    bandwidth = copy_bandwidth(device)
    prompt = torch.randint(3, 500, (prompt_tokens,), device=device, generator=torch.Generator(device).manual_seed(0))
    cuda = device.type == "cuda"
    repeats, calls = (7, 20) if cuda else (3, 3)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": str(dtype).split(".")[-1]}
    result |= {"copy_bandwidth_gbs": bandwidth / 1e9, "k": k, "prompt_tokens": prompt_tokens, "models": {}}
    for role, spec, seed, sizes in (("target", target, 0, (1, k + 1)), ("draft", draft, 1, (1,))):
        lm = static_lm(spec, device, dtype, seed, tokens, k + 1)  # built as a run builds it, outside inference mode
        with torch.inference_mode():  # as the loop decodes
            figures = profile_model(lm, prompt, sizes, repeats, calls)
            if role == "draft":
                figures["drafted_us"] = {
                    f"{name}{'' if chained else ', a token at a time'}": drafted_us(
                        lm, prompt, k, temperature, chained, repeats, calls
                    )
                    for chained in (True, False)
                    for name, temperature in (("greedy", 0.0), ("sampled", 1.0))
                }
                figures["chains"] = len(lm.chained)
            result["models"][role] = figures | {"spec": spec, "name": Path(spec).stem}
            del lm
            if cuda:
                torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - began
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def report(result: dict) -> list[str]:
    """step-profile.md: one table of the steps, the ratios that c and the verify ratio come from, and
    each model's largest kernels."""
    bandwidth = result["copy_bandwidth_gbs"] * 1e9
    target, draft, k = result["models"]["target"], result["models"]["draft"], result["k"]

    def us(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}"

    lines = [
        f"{result['device']}, {result['dtype']}, copy bandwidth {result['copy_bandwidth_gbs']:,.0f} GB/s, "
        f"prompt {result['prompt_tokens']} tokens, K = {k}; microseconds a call, medians.",
        "",
        f"| model, tokens | replay | {'operations' if result['device'] == 'cpu' else 'kernels'} (count, us) | gaps "
        "| loop | synced | host | read at replay |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role, figures in (("target", target), ("draft", draft)):
        for n, row in figures["sizes"].items():
            kernel_cell, gaps, read = "", None, "-"
            if int(n) == 1 and figures["kernels"]:
                total = sum(r["us"] for r in figures["kernels"])
                kernel_cell = f"{sum(r['count'] for r in figures['kernels']):.0f}, {total:,.1f}"
                gaps = None if row["replay_us"] is None else row["replay_us"] - total
            if row["replay_us"] is not None:
                moved = figures["weight_bytes"] + figures["cache_bytes"]
                read = f"{moved / (row['replay_us'] / 1e6) / bandwidth:.1%} of copy"
            lines.append(
                f"| {role} ({figures['name']}), {n} | {us(row['replay_us'])} | {kernel_cell or '-'} | {us(gaps)} | "
                f"{us(row['loop_us'])} | {us(row['synced_us'])} | {us(row['host_us'])} | {read} |"
            )
    one, wide = target["sizes"][1], target["sizes"][k + 1]
    d = draft["sizes"][1]
    drafted = draft["drafted_us"]
    lines += [
        "",
        "| ratio | from replays | from the loop's calls | from synced calls (what runs report) |",
        "|---|---|---|---|",
        f"| c (draft step / target step) | {fmt(ratio(d['replay_us'], one['replay_us']))} | "
        f"{fmt(ratio(d['loop_us'], one['loop_us']))} | {fmt(ratio(d['synced_us'], one['synced_us']))} |",
        f"| verify ratio, K = {k} | {fmt(ratio(wide['replay_us'], one['replay_us']))} | "
        f"{fmt(ratio(wide['loop_us'], one['loop_us']))} | {fmt(ratio(wide['synced_us'], one['synced_us']))} |",
        "",
        f"A drafted token in the loop (ModelDrafter, K = {k}), microseconds and over the target's loop step:",
        "",
        "| drafting | us a token | c |",
        "|---|---|---|",
        *(f"| {name} | {us(t)} | {fmt(ratio(t, one['loop_us']))} |" for name, t in drafted.items()),
        "",
        f"{draft['chains']} chains captured: without any (a CPU), both ways draft a token at a time.",
        "",
        "replay: back-to-back replays of the graph alone; gaps: the replay less its kernels' summed time; loop:",
        "forward and keep back to back, as a decode steps; synced: one call with the device synchronised",
        "around it (models/costs.py); host: issuing that call; read at replay: weights and the whole cache",
        "buffer over the replay's time, against the copy bandwidth.",
    ]
    what = "operation" if result["device"] == "cpu" else "kernel"  # a CPU's profiler sees no kernels
    for role, figures in (("target", target), ("draft", draft)):
        if not figures["kernels"]:  # then the gaps above are the whole replay: say so, not 0 kernels
            lines += ["", f"The profiler saw no {what} of a one-token {role} step."]
            continue
        lines += ["", f"Largest {what}s of a one-token {role} step ({figures['route']}):", ""]
        lines += [f"| {what} | a step | us a step |", "|---|---|---|"]
        for r in figures["kernels"][:TOP_KERNELS]:
            lines.append(f"| {r['kernel'][:90].replace('|', '/')} | {r['count']:.0f} | {r['us']:,.1f} |")
    return lines


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def dry_pair(folder: Path) -> tuple[str, str]:
    """Toy architectures for a CPU run (a 2-layer target and a 1-layer draft), written into ``folder``."""
    paths = []
    for name, (hidden, layers) in {"toy-target": (128, 2), "toy-draft": (64, 1)}.items():
        config = dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=512,
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        )  # fmt: skip
        path = folder / f"{name}.json"
        path.write_text(json.dumps(config))
        paths.append(str(path))
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llama-7b")
    parser.add_argument("--draft", default="llama-68m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128, help="what the reserved cache holds beyond the prompt")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("step-profile"))
    parser.add_argument("--dry", action="store_true", help="a toy pair on the CPU, at toy sizes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry:
        args.target, args.draft = dry_pair(args.out)
        args.device, args.dtype, args.prompt_tokens, args.new_tokens = "cpu", "float32", 16, 8
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("step_profile: no CUDA device (--dry runs a toy pair on the CPU)")
        return 2
    result = measure(
        args.target, args.draft, device, getattr(torch, args.dtype), args.prompt_tokens, args.new_tokens, args.k
    )
    lines = report(result)
    (args.out / "step-profile.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "step-profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
