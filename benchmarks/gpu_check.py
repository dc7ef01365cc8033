"""make gpu-check: specbench's GPU claims checked and measured by one command, offline, in minutes.

    make gpu-check                 # on a machine where torch sees a CUDA device
    make gpu-check WHEELS=DIR      # first installs specbench's missing dependencies from DIR (make gpu-wheels)
    make gpu-check DRY=1           # the same steps on the CPU at toy sizes (the test suite runs this)

Nothing is downloaded: every model is built on the spot with random weights from an architecture
(configs/architectures/, or toy ones in a dry run), and prompts are random tokens. The steps:

  a. the tests marked gpu (speculative sampling's chi-square on the device, its broken control,
     compiled forwards, bfloat16 near-ties, events, peak memory), but for the host-read tests, whose
     decodes step e runs;
  b. greedy decoding in bfloat16 and float32, K 2 and 4: every divergence from the baseline is
     labelled near-tie or structural, and float32 has no structural one;
  c. the mission's pair shape, llama-7b <- llama-68m in bfloat16, K 1,2,3,4,6,8, compiled and eager:
     c, the verify ratio per K + 1, the predicted speedup at alpha 0.6, 0.7, 0.8, peak memory, and the
     baseline's tokens/s against the bound that the measured copy bandwidth puts on reading the weights;
  d. a token tree (2,2) and an EAGLE head of the target's width: that they run, and their costs;
  e. host reads per round, counted as tests/decoding/test_syncs.py counts them, and CUDA's own count of
     synchronising calls (torch.cuda.set_sync_debug_mode).

Steps b and e time nothing, so they run while step a's tests do; c and d then have the GPU to
themselves. Each step is timed; one that fails is reported and the next still runs. Everything lands in
gpu-check/<time>-<device>/: each run's directory, logs, gpu-check.md (the report, rewritten after
every step) and gpu-check.json (its figures). Exit 0 when every step passed, 1 when one failed, 2 when
there is no CUDA device (without --dry).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALPHAS = (0.6, 0.7, 0.8)


@dataclass(frozen=True)
class Sizes:
    """What each step runs: the real shapes on a GPU, toy ones in a dry run."""

    device: str
    greedy_pair: tuple[str, str]
    greedy_prompts: int
    greedy_tokens: int
    pair: tuple[str, str]
    ks: str
    prompts: int
    tokens: int
    prompt_tokens: int
    test_workers: int
    timeouts: dict[str, int]  # seconds per step
    goal_s: int  # what the whole check is meant to fit in, start to report


GPU = Sizes(
    device="cuda",
    greedy_pair=("llama-160m", "llama-68m"),
    greedy_prompts=4,
    greedy_tokens=32,
    pair=("llama-7b", "llama-68m"),
    ks="1,2,3,4,6,8",
    prompts=2,
    tokens=32,
    prompt_tokens=128,
    # 7 tests, two of them long (the CUDA chi-square and its broken control, 89-143 s on H200s):
    # with 4 workers one worker once ran both after three others (235 s). One worker each.
    test_workers=7,
    # Caps, not goals: on H200s a took 198 s, b 72-88 s, c 138-190 s, d 45-61 s; b and e run beside a.
    # e runs in the check's own process: its cap is shown, not enforced (it took 110 s on an H200, most of
    # it compiling, its decodes run twice).
    timeouts={"a": 240, "b": 120, "c": 240, "d": 90, "e": 150},
    goal_s=480,  # 8 minutes on one H100-class GPU: the check fits a short lease with time to run it again
)

# Toy architectures for a dry run, written into the check's folder: a 4-layer grouped-query target and
# a 1-layer draft, so that every code path of the real shapes runs in seconds on a CPU.
TOY = {
    "toy-target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
    "toy-draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2),
}


def dry_sizes(folder: Path) -> Sizes:
    paths = []
    for name, shape in TOY.items():
        config = dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=512,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, **shape,
        )  # fmt: skip
        path = folder / "architectures" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))
        paths.append(str(path))
    pair = (paths[0], paths[1])
    return Sizes(
        device="cpu",
        greedy_pair=pair,
        greedy_prompts=2,
        greedy_tokens=12,
        pair=pair,
        ks="1,2",
        prompts=1,
        tokens=8,
        prompt_tokens=16,
        test_workers=0,  # xdist's start costs more than the skipped tests
        timeouts={"a": 120, "b": 120, "c": 120, "d": 120, "e": 60},
        goal_s=120,  # 2 minutes on a CPU, so the test suite can run it
    )


class StepFailed(Exception):
    """A step's check did not hold, or a command it ran failed: the message says which."""


class Stopped(BaseException):
    """The check itself was told to stop (SIGTERM: a timeout, a lease or a job ending) while a step ran."""


@dataclass
class Outcome:
    status: str  # pass, FAIL or skipped
    summary: str  # the key figures in one line
    details: list[str] = field(default_factory=list)  # markdown for the step's section
    figures: dict = field(default_factory=dict)


@dataclass
class Running:
    """A command of a step, started in its own process session."""

    name: str
    process: subprocess.Popen
    log: Path
    started: float  # time.monotonic()
    deadline: float  # when it is out of time

    def kill(self) -> None:
        # Its own session outlives the check: left running, a 7B run went on using the GPU through
        # the next check's first minute on an H200 (and halved its copy bandwidth).
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@dataclass
class Check:
    """One run of the check: where it writes, what it runs, and what subprocesses see."""

    folder: Path
    sizes: Sizes
    dry: bool
    env: dict[str, str]
    bandwidth: float | None = None  # bytes/s of a device-to-device copy, read + written
    deadline: float = 0.0  # when the step under way is out of time (time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)  # each finished command's wall time, by name
    running: list[Running] = field(default_factory=list)  # the commands started and not yet waited for
    stopped_by: str | None = None  # the signal that told the check to stop

    def stop(self, signum, frame) -> None:
        """The SIGTERM handler: every command of a step is killed at once, then Stopped is raised
        wherever the check is. Code that swallows it (a library's bare except) cannot keep the check
        going: the loop reads stopped_by after each step (once, a timeout's SIGTERM so went unseen)."""
        self.stopped_by = signal.Signals(signum).name
        for running in self.running:
            running.kill()
        raise Stopped(self.stopped_by)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Running:
        """``args`` started with this Python, logged to <name>.log, due by the step's deadline."""
        log = self.folder / f"{name}.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=self.env | (env or {}), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its compile workers are stopped with it
            )  # fmt: skip
        self.running.append(Running(name, process, log, time.monotonic(), self.deadline))
        return self.running[-1]

    def wait(self, running: Running) -> None:
        """Waits for ``running``; a non-zero exit or its time running out fails the step with its
        log's last line."""
        try:
            code = running.process.wait(timeout=max(1.0, running.deadline - time.monotonic()))
        except BaseException as e:  # out of time, or the check itself stopped (Stopped, Ctrl-C)
            running.kill()
            if isinstance(e, subprocess.TimeoutExpired):
                raise StepFailed(f"out of time: {running.name} was stopped (see {running.log.name})") from None
            raise
        finally:
            self.running.remove(running)
        self.seconds[running.name] = time.monotonic() - running.started
        if code != 0:
            lines = [line for line in running.log.read_text(errors="replace").splitlines() if line.strip()]
            last = lines[-1].strip() if lines else "no output"
            raise StepFailed(f"{running.name} exited {code}: {last} (see {running.log.name})")

    def command(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        """``args`` run to the end (start, then wait)."""
        self.wait(self.start(name, args, env))

    def run(self, name: str, target: str, draft: str, *options: str) -> Path:
        """A `specbench run` on random weights into <folder>/<name>/; returns that directory."""
        out = self.folder / name
        prompts = self.folder / "prompts.jsonl"  # random tokens replace them (--prompt-tokens)
        prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(16)))
        args = ["-m", "specbench", "run", "--target", target, "--draft", draft, "--random-weights"]
        args += ["--device", self.sizes.device, "--dataset", str(prompts), "--out", str(out), *options]
        self.command(name, args)
        return out


def read_csv(path: Path) -> list[dict]:
    import pandas as pd

    return pd.read_csv(path, keep_default_na=False).to_dict("records")


def number(x) -> float | None:
    """A CSV cell as a number (a column with empty cells reads as text)."""
    return None if x in ("", None) else float(x)


def fmt(x, digits: int = 2) -> str:
    return "-" if x in ("", None) else f"{float(x):.{digits}f}"


# ---------------------------------------------------------------- a. the tests marked gpu


# Step e decodes the same cases as these tests' cuda ones on the same compiled route and counts CUDA's own
# syncs too. Here, each of them took 83-98 s on an H200, sharing the GPU with 7 other test workers.
COUNTED_IN_STEP_E = "tests/decoding/test_syncs.py"


def start_gpu_tests(check: Check) -> Running:
    """Step a's pytest, started: it runs beside the steps that time nothing (BESIDE_THE_TESTS)."""
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text() and str(p.relative_to(ROOT)) != COUNTED_IN_STEP_E
    )
    workers = ["-n", str(check.sizes.test_workers)]
    # -v names each test's result in tests.log as it finishes, so a step that runs out of time still
    # says which tests passed and which failed; tests.xml holds each one's time and failure.
    # --durations: which tests the step's time went to, for the next run's sizing.
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-v", "--durations=15", "-m", "gpu", *workers]
    args += [f"--junitxml={check.folder / 'tests.xml'}", *files]
    # Each xdist worker compiles, and inductor's pool takes a process per core in each: one run of 6
    # workers so ran past 150 s with one test left. One compile thread each keeps them off each other's cores.
    return check.start("tests", args, {"TORCHINDUCTOR_COMPILE_THREADS": "1"})


def gpu_tests(check: Check, running: Running | None = None) -> Outcome:
    """Step a's outcome: its pytest (``running``, or started now) waited for and read."""
    failed = None
    try:
        check.wait(running or start_gpu_tests(check))
    except StepFailed as e:
        failed = str(e)
    counts, rows = test_results(check.folder)
    summary = ", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v) or "no test ran"
    if counts["FAILED"] or counts["ERROR"] or (failed and "out of time" in failed):
        return Outcome("FAIL", f"{summary}{f'; {failed}' if failed else ''}", rows)
    if not counts["PASSED"]:
        if check.dry and counts["SKIPPED"]:  # a CPU runs none: the dry run checks that they are found
            return Outcome("skipped", f"{summary} (no CUDA device)", rows)
        raise StepFailed(failed or f"no test marked gpu passed ({summary})")
    return Outcome("pass", summary, rows, {"tests": counts})


def test_results(folder: Path) -> tuple[dict[str, int], list[str]]:
    """What tests.log says of each test that has finished: counts by result, and the report's table,
    with each test's seconds where pytest got to write tests.xml (at its end)."""
    log = (folder / "tests.log").read_text(errors="replace")
    cases = {m["name"] or m["later"]: m["result"] or m["first"] for m in RESULT.finditer(log)}
    counts = {r: sum(1 for res in cases.values() if res == r) for r in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    seconds = {}
    if (folder / "tests.xml").is_file():
        from xml.etree import ElementTree

        for case in ElementTree.parse(folder / "tests.xml").iter("testcase"):
            seconds[f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"] = float(case.get("time"))
    rows = [f"| {n} | {r} | {fmt(seconds.get(n), 0)} |" for n, r in cases.items()]
    return counts, ["| test | result | s |", "|---|---|---|", *rows]


# A test's line in pytest -v's output: "tests/f.py::name[id] PASSED", or with xdist "PASSED tests/f.py::name[id]".
NAME = r"tests/[\w/]+\.py::\w+(?:\[[^\]]*\])?"
RESULT = re.compile(
    rf"(?P<name>{NAME}) (?P<result>PASSED|FAILED|ERROR|SKIPPED)|(?P<first>PASSED|FAILED|ERROR|SKIPPED) (?P<later>{NAME})"
)


# ---------------------------------------------------------------- b. greedy in bfloat16 and float32


def greedy(check: Check) -> Outcome:
    s = check.sizes
    rows, figures, problems = (
        ["| dtype | K | equal to the baseline | near-tie | structural |", "|---|---|---|---|---|"],
        {},
        [],
    )
    for dtype in ("bfloat16", "float32"):
        out = check.run(
            f"b-greedy-{dtype}", *s.greedy_pair, "--dtype", dtype, "--k", "2,4",
            "--num-prompts", str(s.greedy_prompts), "--max-new-tokens", str(s.greedy_tokens),
            "--prompt-tokens", str(s.prompt_tokens), "--cost-repeats", "3",
        )  # fmt: skip
        records = [r for r in read_csv(out / "records.csv") if r["method"] != "baseline"]
        for k in sorted({int(r["k"]) for r in records}):
            at = [r for r in records if int(r["k"]) == k]
            labels = [str(r["divergence"]) for r in at if not r["outputs_match"]]
            unlabelled = [x for x in labels if x not in ("near-tie", "structural")]
            near, structural = labels.count("near-tie"), labels.count("structural")
            rows.append(f"| {dtype} | {k} | {len(at) - len(labels)} of {len(at)} | {near} | {structural} |")
            figures[f"{dtype} K={k}"] = {"prompts": len(at), "near_tie": near, "structural": structural}
            if unlabelled:
                problems.append(f"{dtype} K={k}: {len(unlabelled)} divergences without a label")
            if dtype == "float32" and structural:
                problems.append(f"float32 K={k}: {structural} structural divergences")
    summary = "; ".join(f"{key}: {v['structural']} structural, {v['near_tie']} near-tie" for key, v in figures.items())
    if problems:
        raise StepFailed("; ".join(problems))
    return Outcome("pass", summary, rows, figures)


# ---------------------------------------------------------------- c. the mission's pair shape


def mission(check: Check) -> Outcome:
    import torch

    from specbench.models.load import weight_bytes

    s = check.sizes
    alphas = ",".join(str(a) for a in ALPHAS)
    weights = weight_bytes(s.pair[0], torch.bfloat16)
    runs = {}
    for mode in ("compile", "no-compile"):
        out = check.run(
            f"c-{mode}", *s.pair, "--dtype", "bfloat16", "--k", s.ks, f"--{mode}", "--assume-alpha", alphas,
            "--num-prompts", str(s.prompts), "--max-new-tokens", str(s.tokens), "--prompt-tokens", str(s.prompt_tokens),
        )  # fmt: skip
        runs[mode] = out
    figures, problems = {"weight_bytes": weights, "bandwidth_bytes_per_s": check.bandwidth}, []
    for mode, out in runs.items():
        summary = read_csv(out / "summary.csv")
        base = next(r for r in summary if r["method"] == "baseline")
        spec = {int(r["k"]): r for r in summary if r["method"] == "speculative"}
        costs = read_csv(out / "verify_cost.csv")
        ratio = {int(r["tokens"]): float(r["ratio"]) for r in costs if r["model"] == "target"}
        predicted = read_csv(out / "predicted.csv")
        forward = json.loads((out / "meta.json").read_text())["resolved"]["forward"]["target"]
        route = forward["route"]
        tokens_per_s = float(base["baseline_tokens_per_s"])
        figures[mode] = {
            "route": route,
            "run_s": check.seconds[f"c-{mode}"],  # the whole `specbench run`: its log's lines say where it went
            "build_s": forward["build_s"],  # the target's forward built (compiled and warmed, for inductor)
            "c": float(next(iter(spec.values()))["c"]),
            "baseline_tokens_per_s": tokens_per_s,
            "bandwidth_bound_tokens_per_s": check.bandwidth / weights if check.bandwidth else None,
            "mbu": tokens_per_s * weights / check.bandwidth if check.bandwidth else None,
            "peak_memory_mb": max(float(r["peak_memory_mb"] or 0) for r in summary),
            "verify_ratio": {k: ratio.get(k + 1) for k in spec},  # keyed by K: K + 1 tokens
            "predicted_speedup_verify": {
                f"{r['alpha']} K={int(r['k'])}": float(r["predicted_speedup_verify"])
                for r in predicted
                if int(r["k"]) in spec
            },
            "measured_speedup": {k: float(r["speedup"]) for k, r in spec.items()},
        }
        if mode == "compile" and s.device == "cuda" and route != "inductor":
            problems.append(
                f"--compile ran the {route} forward, not inductor: torch.compile failed (see c-compile.log)"
            )
    c, e = figures["compile"], figures["no-compile"]
    rows = [
        f"Target weights {weights / 1e9:.3g} GB (bfloat16, every parameter); copy bandwidth "
        f"{check.bandwidth / 1e9:.0f} GB/s; forward: {c['route']} with --compile, {e['route']} without.",
        "",
        "| | --compile | --no-compile |",
        "|---|---|---|",
        f"| c (draft step / target step) | {c['c']:.3f} | {e['c']:.3f} |",
        f"| baseline tokens/s | {c['baseline_tokens_per_s']:.1f} | {e['baseline_tokens_per_s']:.1f} |",
    ]
    if check.bandwidth:
        rows.append(f"| bound: bandwidth / weight bytes | {c['bandwidth_bound_tokens_per_s']:.1f} | |")
        rows.append(f"| model bandwidth utilisation | {c['mbu']:.1%} | {e['mbu']:.1%} |")
    rows.append(f"| peak memory (MB) | {c['peak_memory_mb']:.0f} | {e['peak_memory_mb']:.0f} |")
    rows.append(f"| target forward built in (s) | {c['build_s']:.1f} | {e['build_s']:.1f} |")
    rows.append(f"| the whole run (s; its log times each stage) | {c['run_s']:.0f} | {e['run_s']:.0f} |")
    rows += ["", "| K | verify ratio (K + 1 tokens) | " + " | ".join(f"predicted at alpha {a}" for a in ALPHAS) + " |"]
    rows.append("|---|---|" + "---|" * len(ALPHAS))
    for k in c["verify_ratio"]:
        cells = [f"{fmt(c['verify_ratio'][k])} / {fmt(e['verify_ratio'][k])}"]
        for a in ALPHAS:
            key = f"{a} K={k}"
            cells.append(f"{c['predicted_speedup_verify'][key]:.2f} / {e['predicted_speedup_verify'][key]:.2f}")
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    rows += ["", "Each cell: --compile / --no-compile. Predicted: E[tokens] / (K c + verify ratio)."]
    summary = (
        f"c {c['c']:.3f} / {e['c']:.3f}, baseline {c['baseline_tokens_per_s']:.1f} / "
        f"{e['baseline_tokens_per_s']:.1f} tok/s"
        + (f" (MBU {c['mbu']:.0%} / {e['mbu']:.0%})" if check.bandwidth else "")
        + f", peak {c['peak_memory_mb'] / 1024:.1f} GiB (compiled / eager)"
    )
    if problems:
        raise StepFailed("; ".join(problems))
    return Outcome("pass", summary, rows, figures)


# ---------------------------------------------------------------- d. a token tree and an EAGLE head


def tree_and_eagle(check: Check) -> Outcome:
    from transformers import AutoConfig

    from specbench.models.load import architecture
    from tests.helpers import build_eagle3_head

    s = check.sizes
    config = AutoConfig.from_pretrained(architecture(s.pair[0]))
    layers = config.num_hidden_layers
    with tempfile.TemporaryDirectory() as scratch:  # the head's weights stay out of the report's folder
        taps = (2, layers // 2, layers - 3) if layers >= 8 else (0, layers // 2, layers - 1)  # EAGLE-3's choice
        head = build_eagle3_head(Path(scratch) / "head", config, taps=taps)
        out = check.run(
            "d-tree-eagle", *s.pair, "--dtype", "bfloat16", "--k", "4", "--method", "tree,eagle", "--tree", "2,2",
            "--speculator", str(head), "--num-prompts", str(s.prompts), "--max-new-tokens", str(s.tokens),
            "--prompt-tokens", str(s.prompt_tokens),
        )  # fmt: skip
    summary = {r["method"]: r for r in read_csv(out / "summary.csv")}
    missing = {"tree", "eagle"} - set(summary)
    if missing:
        raise StepFailed(f"no row for {', '.join(sorted(missing))} in {out.name}/summary.csv")
    rows = ["| method | nodes | c | verify ratio | tokens/s | baseline tokens/s |", "|---|---|---|---|---|---|"]
    figures = {}
    for name in ("tree", "eagle"):
        r = summary[name]
        figures[name] = {
            key: number(r[key]) for key in ("nodes", "c", "verify_ratio", "spec_tokens_per_s", "structural")
        }
        rows.append(
            f"| {name} | {fmt(r['nodes'])} | {fmt(r['c'], 3)} | {fmt(r['verify_ratio'])} | "
            f"{fmt(r['spec_tokens_per_s'], 1)} | {fmt(r['baseline_tokens_per_s'], 1)} |"
        )
    rows += ["", "c: a step of the draft model (tree) or of the head (eagle) over a target step; verify ratio: the"]
    rows += ["target's forward over the round's nodes + 1 over its one-token forward."]
    t, e = figures["tree"], figures["eagle"]
    line = f"tree 2,2: verify ratio {fmt(t['verify_ratio'])}; eagle: c {fmt(e['c'], 3)}, verify ratio {fmt(e['verify_ratio'])}"
    return Outcome("pass", line, rows, figures)


# ---------------------------------------------------------------- e. host reads per round


def host_reads(check: Check) -> Outcome:
    import warnings

    import torch

    from specbench.decoding.decode import STOP_CHECK, autoregressive_decode, speculative_decode
    from specbench.decoding.sampling import Sampling
    from specbench.drafters.lookup import PromptLookupDrafter
    from specbench.drafters.model import ModelDrafter
    from specbench.models.lm import HFCausalLM
    from specbench.models.load import random_model
    from tests.helpers import HostReads

    device = torch.device(check.sizes.device)
    target, draft = (
        HFCausalLM.loaded(m.model, m.width, None, compile=True, name=m.name)
        for m in (random_model(spec, device, torch.float32, seed=i) for i, spec in enumerate(check.sizes.greedy_pair))
    )
    prompt = torch.tensor([5, 9, 14, 5, 9, 14, 5, 9, 3, 7, 5, 9], device=device)  # repeats: lookup finds matches
    rows = ["| decode | rounds | host reads | per round | CUDA syncs | per round |", "|---|---|---|---|---|---|"]
    figures, problems = {}, []
    cases = [(f"{d}, T={t}", d, t) for d in ("draft model", "prompt lookup", "baseline") for t in (0.0, 1.0)]

    def decode(drafting: str, sampling: Sampling, generator: torch.Generator):
        if drafting == "baseline":
            return autoregressive_decode(target, prompt, 40, sampling, generator)
        drafter = ModelDrafter(draft, sampling, generator) if drafting == "draft model" else PromptLookupDrafter()
        return speculative_decode(target, drafter, prompt, 3, 40, sampling, generator)

    for label, drafting, temperature in cases:
        sampling = Sampling(temperature=temperature)
        # Once uncounted first, as a run warms up before it times: the first calls of a compiled forward
        # at each new shape compile, and compiling synchronises (on an H200 the first decode counted 25
        # CUDA syncs more than its rounds, the same decode at T=1 none).
        decode(drafting, sampling, torch.Generator(device).manual_seed(0))
        generator = torch.Generator(device).manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")  # CUDA's own count: each synchronising call warns
            try:
                with HostReads(device) as reads:
                    result = decode(drafting, sampling, generator)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        # The baseline's unit is a read every STOP_CHECK tokens; a chain round's is one read a round.
        rounds = len(result.tokens) if drafting == "baseline" else len(result.accept_counts)
        bound = -(-40 // STOP_CHECK) + 1 if drafting == "baseline" else rounds + 4
        cuda = device.type == "cuda"
        rows.append(
            f"| {label} | {rounds}{' tokens' if drafting == 'baseline' else ''} | {reads.count} | "
            f"{reads.count / rounds:.2f} | {syncs if cuda else '-'} | {f'{syncs / rounds:.2f}' if cuda else '-'} |"
        )
        figures[label] = {"rounds": rounds, "host_reads": reads.count, "cuda_syncs": syncs if cuda else None}
        if reads.count > bound:
            problems.append(f"{label}: {reads.count} host reads in {rounds} rounds (at most {bound})")
        if cuda and syncs > bound:
            problems.append(f"{label}: {syncs} CUDA syncs in {rounds} rounds (at most {bound})")
    rows += [
        "",
        "Host reads as tests/decoding/test_syncs.py counts them (item, tolist, .cpu(), bool(), multinomial, ...);",
    ]
    rows += ["CUDA syncs: the calls that torch.cuda.set_sync_debug_mode('warn') flagged. The baseline's row counts"]
    rows += [
        f"tokens (it reads once every {STOP_CHECK}). Each decode: 40 tokens, K = 3, the {check.sizes.greedy_pair[0]} pair,"
    ]
    rows += ["counted on its second run (the first compiles the forwards' shapes)."]
    chain = figures["draft model, T=1.0"]
    line = f"draft model T=1: {chain['host_reads']} reads in {chain['rounds']} rounds" + (
        f", {chain['cuda_syncs']} CUDA syncs" if device.type == "cuda" else ""
    )
    if problems:  # the table still goes in the report: it says where the reads are
        return Outcome("FAIL", "; ".join(problems), rows, figures)
    return Outcome("pass", line, rows, figures)


STEPS: list[tuple[str, str, Callable[[Check], Outcome]]] = [
    ("a", "the tests marked gpu", gpu_tests),
    ("b", "greedy in bfloat16 and float32", greedy),
    ("c", "the mission's pair shape", mission),
    ("d", "a token tree and an EAGLE head", tree_and_eagle),
    ("e", "host reads per round", host_reads),
]

# The steps that check outputs and counts but time nothing run while step a's tests do (on an H200,
# b took 88 s and e 110 s beside a's 198). c and d time forwards: they have the GPU to themselves.
BESIDE_THE_TESTS = "be"


# ---------------------------------------------------------------- the machine, packages, report


def machine_rows(dry: bool, bandwidth: float, packages: str) -> list[tuple[str, str]]:
    import platform

    import torch
    import transformers

    import specbench
    from specbench.core.machine import driver_version, machine

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    versions = f"{torch.__version__} / {transformers.__version__} / {platform.python_version()}"
    rows = []
    if dry:
        rows.append(("device", f"{machine(None)['cpu']} (dry run: CPU, toy sizes)"))
    else:
        p = torch.cuda.get_device_properties(0)
        rows += [
            ("device", f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB"),
            ("compute capability", f"{p.major}.{p.minor}"),
            ("bfloat16", "supported" if torch.cuda.is_bf16_supported() else "not supported"),
            ("driver", driver_version() or "unknown"),
            ("CUDA (torch's build)", str(torch.version.cuda)),
        ]
    rows += [
        ("torch / transformers / python", versions),
        ("specbench", f"{specbench.__version__} (git {commit.stdout.strip() or 'unknown'})"),
        ("copy bandwidth", f"{bandwidth / 1e9:.0f} GB/s (bytes read + written)"),
        ("packages", packages),
    ]
    return rows


def declared() -> list[str]:
    """specbench's dependencies and its test runner's, as pyproject.toml names them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = project["dependencies"] + ["pytest", "pytest-xdist"]
    return [re.split(r"[<>=!~; \[]", n, maxsplit=1)[0] for n in names]


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def not_installed(names: list[str]) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    gone = []
    for name in names:
        try:
            version(name)
        except PackageNotFoundError:
            gone.append(name)
    return gone


def install_from(wheels: Path, site: Path) -> str:
    """Every distribution in ``wheels`` that is not installed here, into ``site`` (no index, no
    dependency resolution: the folder holds what a stock image lacks, dependencies included)."""
    wanted = not_installed(sorted({normal(w.name.split("-")[0]) for w in wheels.glob("*.whl")}))
    if wanted:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", str(wheels)]
        done = subprocess.run([*pip, "--target", str(site), *wanted], capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            return f"installing {', '.join(wanted)} from {wheels} failed: {tail}"
    return f"installed from {wheels}: {', '.join(wanted)}" if wanted else f"nothing missing that {wheels} holds"


def within(elapsed: float, goal: int) -> str:
    return f"{elapsed:.0f} s in all, {'within' if elapsed <= goal else 'over'} the {goal} s the check is meant to fit"


STOPPED = "stopped by"  # how a step the check was told to stop during begins its summary


def write_report(folder: Path, title: str, machine: list, results: list, elapsed: float, goal: int) -> None:
    lines = [f"# gpu-check: {title}", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in machine]
    stopped = any(outcome.summary.startswith(STOPPED) for _, _, outcome, _ in results)
    lines += ["", f"Stopped after {elapsed:.0f} s, before its end." if stopped else f"{within(elapsed, goal)}."]
    keys = [key for key, *_ in results]
    beside = [key for key in keys if key in BESIDE_THE_TESTS]
    if "a" in keys and beside:
        steps = f"Steps {' and '.join(beside)}" if len(beside) > 1 else f"Step {beside[0]}"
        lines.append(f"{steps} ran while step a's tests did: their seconds overlap a's.")
    lines += ["", "| step | result | s | figures |", "|---|---|---|---|"]
    for key, name, outcome, seconds in results:
        lines.append(f"| {key}. {name} | {outcome.status} | {seconds:.0f} | {outcome.summary} |")
    for key, name, outcome, _ in results:
        lines += ["", f"## {key}. {name}", "", *outcome.details]
    (folder / "gpu-check.md").write_text("\n".join(lines) + "\n")
    figures = {f"{key}. {name}": {"status": o.status, "seconds": s, **o.figures} for key, name, o, s in results}
    whole = {"machine": dict(machine), "seconds": elapsed, "goal_s": goal, "steps": figures}
    (folder / "gpu-check.json").write_text(json.dumps(whole, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the same steps on the CPU at toy sizes")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="where the check's folder goes")
    parser.add_argument("--wheels", type=Path, help="install missing dependencies from this wheel folder")
    parser.add_argument("--steps", default="abcde", help="which steps to run (letters), default all")
    parser.add_argument("--step-timeout", type=int, help="seconds for every step, instead of each one's own")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed: install the torch build of your CUDA first", file=sys.stderr)
        return 2
    if not args.dry and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu-check: torch {torch.__version__} ({build}) sees no CUDA device; run it on a GPU machine, "
            "or `make gpu-check DRY=1` for the CPU rehearsal",
            file=sys.stderr,
        )
        return 2
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"gpu-check: WHEELS={args.wheels} is not a folder: run `make gpu-wheels` where pip can reach an index")
        return 2
    unknown = set(args.steps) - {key for key, _, _ in STEPS}
    if unknown:
        print(f"gpu-check: --steps takes letters of {''.join(k for k, _, _ in STEPS)}, not {''.join(sorted(unknown))}")
        return 2

    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    device_name = "cpu-dry" if args.dry else torch.cuda.get_device_name(0)
    folder = args.out / f"{stamp}-{re.sub(r'[^A-Za-z0-9.]+', '-', device_name).strip('-').lower()}"
    folder.mkdir(parents=True)
    sizes = dry_sizes(folder) if args.dry else GPU

    site = Path(tempfile.mkdtemp(prefix="specbench-gpu-check-site-"))
    gone = not_installed(declared())
    packages = "specbench's dependencies all installed"
    if args.wheels is not None:
        packages = install_from(args.wheels.resolve(), site)
        sys.path.insert(0, str(site))
    elif gone:
        packages = f"missing: {', '.join(gone)} (WHEELS=DIR installs them; the steps do not need them)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "160"}
    if args.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, str(ROOT))

    from rich.console import Console

    from specbench.models.costs import copy_bandwidth  # what `specbench run` measures for baseline_mbu

    console = Console(stderr=True)
    bandwidth = copy_bandwidth(sizes.device)
    machine = machine_rows(args.dry, bandwidth, packages)
    title = f"{device_name}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    console.print(f"gpu-check on {title} -> {folder}")
    for key, value in machine:
        console.print(f"  {key}: {value}")
    check = Check(folder, sizes, args.dry, env, bandwidth)
    steps = {key: (name, step) for key, name, step in STEPS if key in args.steps}
    results: list[tuple[str, str, Outcome, float]] = []

    def record(key: str, outcome: Outcome, start: float) -> None:
        seconds = time.monotonic() - start
        results.append((key, steps[key][0], outcome, seconds))
        results.sort(key=lambda result: result[0])  # the report reads a to e, whatever order they ran in
        style = {"pass": "green", "FAIL": "bold red"}.get(outcome.status, "yellow")
        console.print(f"[{style}]{outcome.status:>7}[/] {key}. {steps[key][0]} ({seconds:.0f} s): {outcome.summary}")
        write_report(folder, title, machine, results, time.monotonic() - started, sizes.goal_s)

    signal.signal(signal.SIGTERM, check.stop)
    tests = None  # step a's pytest, running beside the steps that time nothing
    key, start = None, time.monotonic()
    try:
        if "a" in steps:
            check.deadline = time.monotonic() + (args.step_timeout or sizes.timeouts["a"])
            tests = start_gpu_tests(check)
        first = BESIDE_THE_TESTS if tests else ""  # without the tests, the steps run in order
        for key in [k for k in steps if k in first] + [k for k in steps if k not in first]:
            name, step = steps[key]
            if key == "a":  # the tests were started first, and are due by their own deadline
                start, limit = tests.started, round(tests.deadline - tests.started)
                step = partial(gpu_tests, running=tests)
            else:
                start, limit = time.monotonic(), args.step_timeout or sizes.timeouts[key]
                check.deadline = start + limit
            beside = " beside a's tests" if tests and key in BESIDE_THE_TESTS else ""
            with console.status(f"{key}. {name}{beside} (up to {limit} s; logs in {folder.name}/)"):
                try:
                    outcome = step(check)
                except StepFailed as e:
                    outcome = Outcome("FAIL", str(e))
                except Exception as e:  # noqa: BLE001 - a broken step is reported; the next one still runs
                    outcome = Outcome("FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if check.stopped_by:  # told to stop, and the Stopped raised within the step was swallowed
                raise Stopped(check.stopped_by)
            record(key, outcome, start)
    except (Stopped, KeyboardInterrupt) as e:
        # The steps done are in the report already; the one under way is marked, and no other starts.
        by, done = f"{STOPPED} {e or 'Ctrl-C'}", {k for k, *_ in results}

        def stopped(k: str, since: float, how: str) -> None:
            counts, rows = test_results(folder) if k == "a" else ({}, [])  # the tests that finished say so
            so_far = ", ".join(f"{v} {r.lower()}" for r, v in counts.items() if v)
            text = f"{by} after {time.monotonic() - since:.0f} s{how}" + (f" ({so_far} by then)" if so_far else "")
            record(k, Outcome("FAIL", text, rows), since)

        if tests is not None and "a" not in done and key != "a":  # the tests, beside the step under way
            tests.kill()
            stopped("a", tests.started, f", beside {key}")
        if key is not None and key not in done:
            stopped(key, start, "; no later step ran")
        console.print(f"[bold red]stopped[/]: report: {folder / 'gpu-check.md'}")
        return 1
    failed = [key for key, _, o, _ in results if o.status == "FAIL"]
    console.print(f"report: {folder / 'gpu-check.md'} ({within(time.monotonic() - started, sizes.goal_s)})")
    if failed:
        console.print(f"[bold red]failed: {', '.join(failed)}[/]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
