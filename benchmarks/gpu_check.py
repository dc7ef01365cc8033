"""make gpu-check: specbench's GPU claims checked and measured by one command, offline, in minutes.

    make gpu-check                 # on a machine where torch sees a CUDA device
    make gpu-check WHEELS=DIR      # first installs specbench's missing dependencies from DIR (make gpu-wheels)
    make gpu-check DRY=1           # the same steps on the CPU at toy sizes (the test suite runs this)

Nothing is downloaded: every model is built on the spot with random weights, from an architecture
(configs/architectures/, or toy ones in a dry run) or as a small checkpoint, and prompts are random
tokens. Every run that a `specbench run` on CUDA would put on the static path passes --graphs (on the
CPU of a dry run that path is compiled by inductor without graphs: route static-inductor). The steps:

  a. the tests marked gpu (speculative sampling's chi-square on the device, on the fast forward and on
     CUDA graphs, with their broken controls; compiled forwards, bfloat16 near-ties, events, peak
     memory), but for the host-read tests, whose decodes step e runs;
  b. greedy decoding on the static path, K 2 and 4: llama-160m <- llama-68m in bfloat16 and float32
     (every divergence from the baseline labelled near-tie or structural, float32 with no structural
     one) and a small Qwen3-shaped pair in float32, equal to the baseline on every prompt;
  c. the mission's pair shape, llama-7b <- llama-68m in bfloat16, on three routes: CUDA graphs
     (--graphs), inductor (--no-graphs --compile) and transformers' eager forward: the baseline's
     tokens/s and bandwidth utilisation, c, the verify ratio per K, the predicted speedups, peak
     memory, build and capture times; and on CUDA graphs, --synthetic-acceptance 0.6 and 0.8 at K 2
     and 4, the measured speedup against the one predicted from the run's measured costs;
  d. a token tree (2,2) and an EAGLE head of the target's width on the static path: that they run,
     and their costs;
  e. host reads per round on the static path, counted as tests/decoding/test_syncs.py counts them, and
     CUDA's own count of synchronising calls (torch.cuda.set_sync_debug_mode);
  f. where a step of c's pair goes (benchmarks/step_profile.py): each model's graph replayed alone, its
     kernels, the forward as the loop calls it and as the costs time it, the host's part, and a draft
     step with its sampling, so that a goal c misses says where the time went.

Steps b and e time nothing, so they run while step a's tests do; c and d then have the GPU to
themselves. Each step is timed; one that fails is reported and the next still runs. The report also
judges issue 72's goals for the static path (the *_GOAL constants: bandwidth, c, verify ratio, the
synthetic speedup; and exactness): a goal not met is reported, and fails no step; a wrong route or an output
that parts from the baseline's fails its step. Everything lands in gpu-check/<time>-<device>/: each
run's directory, logs, gpu-check.md (the report, rewritten after every step) and gpu-check.json (its
figures). Exit 0 when every step passed, 1 when one failed, 2 when there is no CUDA device (without --dry).
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
ALPHAS = (0.6, 0.7, 0.8)  # --assume-alpha: predicted.csv's speedups at these alphas, from each run's measured costs
SYNTHETIC = (0.6, 0.8)  # step c's --synthetic-acceptance runs on CUDA graphs, one each
SYNTHETIC_KS = (2, 4)
COMPARED_K = 4  # the inductor and eager runs of step c: one K gives c (verify_cost.csv times 1..8 tokens whatever K is)
SHOWN_KS = (1, 2, 3, 4, 6)  # verify ratios and predictions in the report: K + 1 <= 8 tokens, what every run times

# Issue 72's goals for the static path on CUDA, judged in the report: a goal not met is reported, and
# fails no step (the check measures; the issue's done-when is the target it reports against).
MBU_GOAL = 0.75  # the baseline's bandwidth utilisation: its step at >= 75% of the measured copy bandwidth
C_GOAL = 0.03  # c: the draft's step over the target's
VERIFY_GOAL = (1.10, 4)  # the verify ratio at every K up to 4
SPEEDUP_GOAL = (0.8, 4, 2.5, 0.9)  # at synthetic acceptance 0.8 and K 4: a speedup >= 2.5x and >= 0.9 of the prediction


@dataclass(frozen=True)
class Sizes:
    """What each step runs: the real shapes on a GPU, toy ones in a dry run."""

    device: str
    greedy_pair: tuple[str, str]
    greedy_prompts: int
    greedy_tokens: int
    pair: tuple[str, str]
    prompts: int  # step c's inductor and eager runs, and step d
    tokens: int
    graph_prompts: int  # step c's runs on CUDA graphs (synthetic acceptance)
    graph_tokens: int
    prompt_tokens: int
    test_workers: int
    timeouts: dict[str, int]  # seconds per step
    run_options: tuple[str, ...]  # passed to every `specbench run`
    goal_s: int  # what the whole check is meant to fit in, start to report


# The whole check, estimated for an H200 (these steps have not run on one yet; the last full run took
# 433 s: a 198, c 169, d 61, b and e beside a). a about 200 s: 10 tests, a worker each, the two CUDA
# chi-squares (the fast forward's and the static path's) and their controls the long ones. Beside it,
# b about 70 s (its three runs at once, each compiling its pair's graphs), then e 110 s. Each 7B
# process costs about 35 s beside its decoding and compiling (start, imports, random weights, costs,
# files: what the last c runs, 85 s each, and d, 61 s, leave after theirs). c: graphs at 0.6 35 + 40
# compiling (inductor's cache cold) + 10 decoding, graphs at 0.8 35 + 20 (the cache warm: dynamo still
# traces) + 10, inductor 35 + 12 + 7, eager 35 + 7: about 245 s. d about 90 s: the EAGLE head built,
# and the 7B forward compiled again to record the head's features (d decodes as long as c's graph runs,
# so its cache is theirs and inductor's cache serves the tree's forwards: the static path compiles for
# the cache's size).
# In all about 200 + 245 + 90 + 5 = 540 s, a minute over the goal: every figure here but a's is a
# guess (compiling above all), and each run's log times its stages and meta.json its build and
# capture, so the first run says where to cut. c comes before d: a lease that ends first stops d.
# f (new, unmeasured) builds the 7B once more in a process of its own and compiles it from inductor's
# cache: about 80 s, which takes the whole check past its 8 minutes; it runs before d, and a short
# lease runs --steps cf.
GPU = Sizes(
    device="cuda",
    greedy_pair=("llama-160m", "llama-68m"),
    greedy_prompts=4,
    greedy_tokens=32,
    pair=("llama-7b", "llama-68m"),
    prompts=2,
    tokens=32,
    # 4 x 127 decode steps at K 4 and acceptance 0.8 are about 150 rounds: the measured tokens per round
    # within about 3% of E[tokens] (one standard error), in 2-3 s of decoding per method on graphs.
    graph_prompts=4,
    graph_tokens=128,
    prompt_tokens=128,
    # 12 tests, four of them long (the two CUDA chi-squares and their broken controls; the fast forward's
    # took 89-143 s on H200s): with 4 workers one worker once ran two after three others (235 s). One
    # each but for the two new short ones (a failed capture's recovery, the copy's timing by events),
    # which take a second or two beside another.
    test_workers=10,
    # Caps, not goals: on H200s a took 198 s, b 72-88 s, c 138-190 s, d 45-61 s before the static path;
    # b and e run beside a. e runs in the check's own process: its cap is shown, not enforced (it took
    # 110 s on an H200, most of it compiling, its decodes run twice).
    timeouts={"a": 270, "b": 200, "c": 330, "d": 150, "e": 150, "f": 150},
    run_options=(),
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
        # The static path compiles for its cache's size (prompt + new tokens + the widest forward, rounded
        # up by static.cache_positions): here b's bfloat16 run, c's graphs runs and d's all hold 256
        # positions, so the toy pair's forwards are compiled once, in b, and read from inductor's cache after.
        prompts=1,
        tokens=10,
        graph_prompts=1,
        graph_tokens=12,
        prompt_tokens=16,
        test_workers=0,  # xdist's start costs more than the skipped tests
        timeouts={"a": 120, "b": 180, "c": 180, "d": 120, "e": 60, "f": 60},
        # One torch thread a run: b's runs share the CPU with each other and with a's pytest, and two
        # threads spinning against a busy core made a toy forward take 200 ms instead of 1.
        run_options=("--threads", "1"),
        goal_s=120,  # 2 minutes on a CPU, so the test suite can run it
    )


# A small Qwen3-shaped pair for step b's exactness run, as checkpoints with a tokenizer: grouped heads
# with head_dim set apart from the width (Qwen3's per-head query and key norms act over it), tied
# embeddings, and a draft whose vocabulary is padded 64 rows wider than the tokenizer's (the target's
# is not), as model families with one tokenizer often are. The draft is the target's first layer over
# its embedding, so it agrees with the target on about a quarter of its drafts (alpha 0.24-0.26 at K 2
# and 4 on the CPU): rounds that keep some drafts and reject the rest, where a cache that rolls back
# wrongly shows. The layers' outputs are amplified (QWEN3_GAIN) over the tied embedding, which a random
# model otherwise repeats, token after token.
QWEN3 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
QWEN3_LAYERS = (2, 1)  # target, draft
QWEN3_PADDING = 64  # the draft's vocabulary rows past the tokenizer's
QWEN3_GAIN = 5.0


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
    goals: list[dict] = field(default_factory=list)  # issue 72's goals this step judged (issue_goal)


def issue_goal(text: str, measured: str, met: bool | None) -> dict:
    """One of issue 72's goals as the report lists it: met, not met, or not run (``met`` None)."""
    return {"goal": text, "measured": measured, "verdict": "not run" if met is None else "met" if met else "not met"}


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
    compared: tuple[str, ...] = ()  # the routes (of COMPARED) that step c times beside the graphs
    stopped_by: str | None = None  # the signal that told the check to stop
    starting: bool = False  # start() is starting a process: a stop waits until it is in self.running

    def stop(self, signum, frame) -> None:
        """The SIGTERM handler: every command of a step is killed at once, then Stopped is raised
        wherever the check is. Code that swallows it (a library's bare except) cannot keep the check
        going: the loop reads stopped_by after each step (once, a timeout's SIGTERM so went unseen)."""
        self.stopped_by = signal.Signals(signum).name
        for running in self.running:
            running.kill()
        if not self.starting:  # else start() raises it once the process it is starting is in the list
            raise Stopped(self.stopped_by)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Running:
        """``args`` started with this Python, logged to <name>.log, due by the step's deadline."""
        log = self.folder / f"{name}.log"
        # A stop raised inside Popen would leave its new process running, in no list (step b starts
        # three at once, and CI once saw one left): while starting, the handler kills the others and
        # returns, and the stop is raised here, once this one is in the list too.
        self.starting = True
        try:
            with log.open("w") as out:
                process = subprocess.Popen(
                    [sys.executable, *args], cwd=ROOT, env=self.env | (env or {}), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,  # its compile workers are stopped with it
                )  # fmt: skip
            self.running.append(Running(name, process, log, time.monotonic(), self.deadline))
        finally:
            self.starting = False
        if self.stopped_by:
            for running in self.running:
                running.kill()
            raise Stopped(self.stopped_by)
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

    def run(self, name: str, target: str, draft: str, *options: str, dataset: Path | None = None) -> Path:
        """A `specbench run` into <folder>/<name>/, run to its end; returns that directory."""
        running, out = self.start_run(name, target, draft, *options, dataset=dataset)
        self.wait(running)
        return out

    def start_run(
        self, name: str, target: str, draft: str, *options: str, dataset: Path | None = None
    ) -> tuple[Running, Path]:
        """A `specbench run` into <folder>/<name>/, started: on random weights and random prompts, or,
        given a ``dataset``, on the checkpoints ``target`` and ``draft`` name."""
        out = self.folder / name
        if dataset is None:
            dataset = self.folder / "prompts.jsonl"  # random tokens replace them (--prompt-tokens)
            if not dataset.is_file():  # written once: a run started before may be reading it
                dataset.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(16)))
            options = ("--random-weights", *options)
        args = ["-m", "specbench", "run", "--target", target, "--draft", draft, *options, *self.sizes.run_options]
        args += ["--device", self.sizes.device, "--dataset", str(dataset), "--out", str(out)]
        return self.start(name, args), out


def read_csv(path: Path) -> list[dict]:
    import pandas as pd

    return pd.read_csv(path, keep_default_na=False).to_dict("records")


def number(x) -> float | None:
    """A CSV cell as a number (a column with empty cells reads as text)."""
    return None if x in ("", None) else float(x)


def fmt(x, digits: int = 2) -> str:
    return "-" if x in ("", None) else f"{float(x):.{digits}f}"


def static_route(check: Check) -> str:
    """The route --graphs gives on the check's device: CUDA graphs, or on a CPU inductor without graphs."""
    return "static-inductor" if check.dry else "graphs"


def forwards(out: Path) -> dict[str, dict]:
    """What ran each model's forward in the run in ``out``, by role (meta.json's resolved.forward)."""
    return json.loads((out / "meta.json").read_text())["resolved"]["forward"]


# The log lines that say why a model left the static path: the path does not cover it, or compiling failed.
WHY_NOT_STATIC = re.compile(r"\S+ runs without the static path: .*|torch\.compile failed.*")


def route_problem(out: Path, wanted: str, roles: tuple[str, ...] = ("target", "draft")) -> str | None:
    """None when the ``roles`` of the run in ``out`` ran the ``wanted`` forward; else which did not,
    and why, as the run's log (<name>.log beside it) says."""
    off = {role: facts["route"] for role, facts in forwards(out).items() if role in roles and facts["route"] != wanted}
    if not off:
        return None
    log = out.parent / f"{out.name}.log"
    why = WHY_NOT_STATIC.search(log.read_text(errors="replace")) if log.is_file() else None
    routes = ", ".join(f"the {role} {route}" for role, route in off.items())
    return (
        f"{out.name} ran {routes}, not {wanted}: {why[0].strip() if why else 'its log says no more'} (see {log.name})"
    )


# ---------------------------------------------------------------- a. the tests marked gpu


# Step e decodes the same cases as these tests' cuda-graphs ones on the same route (CUDA's default, the
# static path) and counts CUDA's own syncs too. Here, each of their cuda ones (the --no-graphs --compile
# route, whose counts step e gave on an H200 on 2026-11-28) took 83-98 s, sharing the GPU with 7 other
# test workers.
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
    goals = [law_goal(test_cases(check.folder))]
    summary = ", ".join(f"{v} {k.lower()}" for k, v in counts.items() if v) or "no test ran"
    if counts["FAILED"] or counts["ERROR"] or (failed and "out of time" in failed):
        return Outcome("FAIL", f"{summary}{f'; {failed}' if failed else ''}", rows, goals=goals)
    if not counts["PASSED"]:
        if check.dry and counts["SKIPPED"]:  # a CPU runs none: the dry run checks that they are found
            return Outcome("skipped", f"{summary} (no CUDA device)", rows, goals=goals)
        raise StepFailed(failed or f"no test marked gpu passed ({summary})")
    return Outcome("pass", summary, rows, {"tests": counts}, goals)


# Issue 72's "the CUDA chi-square passes and its broken control fails" on the static path: the cuda
# cases of its law tests (a control's test passes when the chi-square catches the broken forward).
STATIC_LAW_TESTS = re.compile(r"tests/models/test_static\.py::\w+\[graphs\]")


def law_goal(cases: dict[str, str]) -> dict:
    found = {name: result for name, result in cases.items() if STATIC_LAW_TESTS.fullmatch(name)}
    ran = {name: result for name, result in found.items() if result != "SKIPPED"}
    passed = [name for name, result in ran.items() if result == "PASSED"]
    measured = f"{len(passed)} of {len(ran)} passed" if ran else f"{len(found)} found, none ran"
    if len(passed) < len(ran):
        measured += ": not " + ", ".join(name.split("::")[1] for name in ran if name not in passed)
    text = "the chi-square on CUDA graphs passes and its broken control fails (tests/models/test_static.py's [graphs] cases)"
    return issue_goal(text, measured, len(passed) == len(ran) if ran else None)


def test_cases(folder: Path) -> dict[str, str]:
    """Each test that tests.log says has finished, and its result (PASSED, FAILED, ERROR, SKIPPED)."""
    log = (folder / "tests.log").read_text(errors="replace")
    return {m["name"] or m["later"]: m["result"] or m["first"] for m in RESULT.finditer(log)}


def test_results(folder: Path) -> tuple[dict[str, int], list[str]]:
    """What tests.log says of each test that has finished: counts by result, and the report's table,
    with each test's seconds where pytest got to write tests.xml (at its end)."""
    cases = test_cases(folder)
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


# ---------------------------------------------------------------- b. greedy on the static path


def greedy(check: Check) -> Outcome:
    """Greedy decodes on the static path against the baseline's: the Llama pair in bfloat16 (a divergence
    only at a near-tie) and float32 (no structural one), the Qwen3-shaped pair in float32 (none at all).
    The three runs time nothing, so they run at once."""
    s = check.sizes
    qwen3 = build_qwen3_pair(check.folder / "qwen3")
    llama = " <- ".join(Path(m).stem for m in s.greedy_pair)
    runs = [  # name, the pair in the report, target, draft, dtype, prompts (None: random ones)
        ("b-greedy-bfloat16", llama, *s.greedy_pair, "bfloat16", None),
        ("b-greedy-float32", llama, *s.greedy_pair, "float32", None),
        (QWEN3_RUN, "Qwen3-shaped", *qwen3, "float32", check.folder / "qwen3" / "prompts.jsonl"),
    ]
    options = ["--graphs", "--k", "2,4", "--num-prompts", str(s.greedy_prompts)]
    options += ["--max-new-tokens", str(s.greedy_tokens), "--cost-repeats", "3"]
    started = []
    for name, pair, target, draft, dtype, dataset in runs:
        random_prompts = ["--prompt-tokens", str(s.prompt_tokens)] if dataset is None else []
        running, out = check.start_run(
            name, target, draft, "--dtype", dtype, *options, *random_prompts, dataset=dataset
        )
        started.append((name, pair, dtype, running, out))
    rows = ["| pair | dtype | K | equal to the baseline | near-tie | structural |", "|---|---|---|---|---|---|"]
    figures, problems = {"routes": {}}, []
    for name, pair, dtype, running, out in started:
        try:
            check.wait(running)
        except StepFailed as e:
            problems.append(str(e))
            continue
        if problem := route_problem(out, static_route(check)):
            problems.append(problem)  # its outputs are still compared below
        figures["routes"][name] = forwards(out)["target"]["route"]
        prefix = "qwen3 " if name == QWEN3_RUN else ""
        counts, found = outputs_against_baseline(read_csv(out / "records.csv"), prefix + dtype, every=name == QWEN3_RUN)
        for key, v in counts.items():
            k = key.split("K=")[1]
            rows.append(
                f"| {pair} | {dtype} | {k} | {v['equal']} of {v['prompts']} | {v['near_tie']} | {v['structural']} |"
            )
        figures |= counts
        problems += found
    rows += ["", f"Every run: --graphs (route {static_route(check)}). The Qwen3-shaped pair: {qwen3_shape()}."]
    compared = {key: v for key, v in figures.items() if key != "routes"}
    summary = "; ".join(
        f"{key}: {v['equal']} of {v['prompts']} equal"
        + (f", {v['near_tie']} near-tie" if v["near_tie"] else "")
        + (f", {v['structural']} structural" if v["structural"] else "")
        for key, v in compared.items()
    )
    goals = greedy_goals(compared, figures["routes"], problems)
    if problems:  # the table still goes in the report
        return Outcome("FAIL", "; ".join(problems), rows, figures, goals)
    return Outcome("pass", summary, rows, figures, goals)


QWEN3_RUN = "b-qwen3-float32"


def outputs_against_baseline(records: list[dict], label: str, every: bool) -> tuple[dict[str, dict], list[str]]:
    """One run's greedy outputs against its baseline's, by K ("<label> K=<k>"): how many prompts, how
    many equal, how many parted at a near-tie and how many structurally; and what fails step b: a
    divergence without a label, a structural one in float32, and, with ``every``, any divergence."""
    records = [r for r in records if r["method"] != "baseline"]
    counts, problems = {}, []
    for k in sorted({int(r["k"]) for r in records}):
        at = [r for r in records if int(r["k"]) == k]
        labels = [str(r["divergence"]) for r in at if not r["outputs_match"]]
        near, structural = labels.count("near-tie"), labels.count("structural")
        key = f"{label} K={k}"
        counts[key] = {"prompts": len(at), "equal": len(at) - len(labels), "near_tie": near, "structural": structural}
        if len(labels) > near + structural:
            problems.append(f"{key}: {len(labels) - near - structural} divergences without a label")
        if "float32" in label and structural:
            problems.append(f"{key}: {structural} structural divergences")
        if every and labels:  # near-tie or not
            problems.append(f"{key}: {len(labels)} of {len(at)} outputs differ from the baseline's")
    return counts, problems


def greedy_goals(counts: dict, routes: dict, problems: list[str]) -> list[dict]:
    """Issue 72's exactness goals from step b's ``counts`` (by "[qwen3 ]dtype K=k"): float32 equal to the
    baseline on every prompt, both pairs; and the Qwen3-shaped pair's step passed (its run on the
    static path, no ``problems``, every output equal)."""
    float32 = {key: v for key, v in counts.items() if "float32" in key}
    qwen3 = {key: v for key, v in float32.items() if key.startswith("qwen3")}
    equal = [v["equal"] == v["prompts"] for v in float32.values()]
    ours = [p for p in problems if QWEN3_RUN in p or p.startswith("qwen3")]
    measured = "; ".join(ours) or (
        f"{sum(v['equal'] for v in qwen3.values())} of {sum(v['prompts'] for v in qwen3.values())} outputs equal "
        f"at K 2 and 4, on {routes.get(QWEN3_RUN)}"
    )
    return [
        issue_goal(
            "float32 greedy equal on every prompt",
            ", ".join(f"{key}: {v['equal']} of {v['prompts']}" for key, v in float32.items()) or "no run finished",
            all(equal) if equal else None,
        ),
        issue_goal("the Qwen3-shaped pair passes its exactness step", measured, not ours if qwen3 or ours else None),
    ]


def qwen3_shape() -> str:
    target, draft = QWEN3_LAYERS
    return (
        f"{target} and {draft} layers of width {QWEN3['hidden_size']}, {QWEN3['num_attention_heads']} query heads on "
        f"{QWEN3['num_key_value_heads']} key/value heads of head_dim {QWEN3['head_dim']}, tied embeddings; the draft is "
        f"the target's first {'layer' if draft == 1 else f'{draft} layers'}, its vocabulary {QWEN3_PADDING} rows wider"
    )


def build_qwen3_pair(root: Path) -> tuple[str, str]:
    """The Qwen3-shaped pair (QWEN3) as two checkpoint directories sharing a tokenizer, and its prompts
    in <root>/prompts.jsonl."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging

    from tests.helpers import CORPUS, build_tokenizer

    logging.disable_progress_bar()  # save_pretrained's, in the check's console

    tokenizer = build_tokenizer(root / "tokenizer")
    models = []
    for layers, padding in zip(QWEN3_LAYERS, (0, QWEN3_PADDING), strict=True):
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=len(tokenizer) + padding, num_hidden_layers=layers, max_position_embeddings=512,
            tie_word_embeddings=True, **QWEN3,
        )  # fmt: skip
        models.append(Qwen3ForCausalLM(config).eval())
    target, draft = models
    with torch.no_grad():
        for layer in target.model.layers:
            attention = layer.self_attn  # norms of ones would hide a norm applied to the wrong half
            attention.q_norm.weight.normal_(1.0, 0.3)
            attention.k_norm.weight.normal_(1.0, 0.3)
            attention.o_proj.weight.mul_(QWEN3_GAIN)
            layer.mlp.down_proj.weight.mul_(QWEN3_GAIN)
        draft.model.embed_tokens.weight[: len(tokenizer)] = target.model.embed_tokens.weight
        for mine, its in zip(draft.model.layers, target.model.layers, strict=False):
            mine.load_state_dict(its.state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    paths = []
    for role, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
        paths.append(str(root / role))
    prompts = "".join(json.dumps({"prompt": text}) + "\n" for text in dict.fromkeys(CORPUS))
    (root / "prompts.jsonl").write_text(prompts)
    return paths[0], paths[1]


# ---------------------------------------------------------------- c. the mission's pair shape


# Step c's runs beside CUDA graphs' (--graphs), for comparison, and their flags.
COMPARED = {"compiled": ("--no-graphs", "--compile"), "eager": ("--no-graphs", "--no-compile")}


def mission(check: Check) -> Outcome:
    s = check.sizes
    common = ["--dtype", "bfloat16", "--prompt-tokens", str(s.prompt_tokens), "--assume-alpha"]
    common += [",".join(map(str, ALPHAS))]
    synthetic = {}
    for a in SYNTHETIC:
        synthetic[a] = check.run(
            f"c-graphs-{a}", *s.pair, *common, "--graphs", "--synthetic-acceptance", str(a),
            "--k", ",".join(map(str, SYNTHETIC_KS)), "--num-prompts", str(s.graph_prompts),
            "--max-new-tokens", str(s.graph_tokens),
        )  # fmt: skip
    # The graphs column is the last synthetic run's: acceptance set by hand changes what a round keeps,
    # not what a forward costs, and a run of its own would compile the 7B graphs once more.
    runs = {"graphs": synthetic[SYNTHETIC[-1]]}
    for route, flags in ((r, COMPARED[r]) for r in check.compared):
        runs[route] = check.run(
            f"c-{route}", *s.pair, *common, *flags, "--k", str(COMPARED_K), "--num-prompts", str(s.prompts),
            "--max-new-tokens", str(s.tokens),
        )  # fmt: skip
    # The route each run must have taken, for which models. A CPU's compiled forward is own or packed.
    wanted = [(out, static_route(check), ("target", "draft")) for out in synthetic.values()]
    if "compiled" in runs:
        wanted += [(runs["compiled"], None if check.dry else "inductor", ("target",))]
    if "eager" in runs:
        wanted += [(runs["eager"], "eager", ("target", "draft"))]
    problems = [problem for out, route, roles in wanted if route and (problem := route_problem(out, route, roles))]
    columns = {route: route_figures(check, out) for route, out in runs.items()}
    rows = {f"{a} K={k}": row for a, out in synthetic.items() for k, row in synthetic_rows(out, a).items()}
    figures = {**columns, "synthetic": rows}
    goals = mission_goals(columns["graphs"], rows)
    details = mission_report(check, columns, rows)
    g = columns["graphs"]
    a, k, *_ = SPEEDUP_GOAL
    judged = rows[f"{a} K={k}"]
    others = ", ".join(f"{x['route']} {x['baseline_tokens_per_s']:.1f}" for r, x in columns.items() if r != "graphs")
    summary = (
        f"{g['route']}: baseline {g['baseline_tokens_per_s']:.1f} tok/s (MBU {percent(g['mbu'])}), c {g['c']:.3f}, "
        f"at acceptance {a} and K {k} {judged['decode_speedup']:.2f}x of {judged['predicted_speedup_verify']:.2f}x "
        f"predicted; {others + ' tok/s' if others else 'no other route run (--routes)'}; "
        f"{sum(x['verdict'] == 'met' for x in goals)} of {len(goals)} goals met"
    )
    if problems:  # the tables still go in the report
        return Outcome("FAIL", "; ".join(problems), details, figures, goals)
    return Outcome("pass", summary, details, figures, goals)


def route_figures(check: Check, out: Path) -> dict:
    """One column of step c's table: what the run in ``out`` measured of its baseline, its costs and its forwards."""
    summary = read_csv(out / "summary.csv")
    base = next(r for r in summary if r["method"] == "baseline")
    spec = next(r for r in summary if r["method"] == "speculative")
    costs = [r for r in read_csv(out / "verify_cost.csv") if r["model"] == "target" and int(r["tokens"]) > 1]
    baseline = [r for r in read_csv(out / "records.csv") if r["method"] == "baseline"]
    facts = forwards(out)
    return {
        "run": out.name,
        "route": facts["target"]["route"],
        "draft_route": facts["draft"]["route"],
        "run_s": check.seconds[out.name],  # the whole `specbench run`: its log's lines say where it went
        "build_s": {role: f["build_s"] for role, f in facts.items()},  # compiled and warmed, for inductor and graphs
        "graphs": {role: f.get("graphs", []) for role, f in facts.items()},  # token counts captured
        "capture_s": sum(f.get("capture_s", 0.0) for f in facts.values()),
        "graphs_mb": sum(f.get("graphs_mb", 0.0) for f in facts.values()),  # the logits they hold
        "baseline_tokens_per_s": float(base["baseline_tokens_per_s"]),
        "decode_tokens_per_s": sum(r["new_tokens"] - 1 for r in baseline)
        / sum(r["method_s"] - r["prefill_s"] for r in baseline),
        "mbu": value(base["baseline_mbu"]),  # the run's own: weights and KV cache a step reads, over its copy bandwidth
        "weight_bytes": value(base["weight_bytes"]),
        "copy_bandwidth_gbs": value(base["copy_bandwidth_gbs"]),
        "c": float(spec["c"]),
        "verify_ratio": {int(r["tokens"]) - 1: float(r["ratio"]) for r in costs},  # keyed by K: K + 1 tokens
        "predicted_speedup_verify": {
            f"{r['alpha']} K={int(r['k'])}": float(r["predicted_speedup_verify"])
            for r in read_csv(out / "predicted.csv")
        },
        "peak_memory_mb": max(float(r["peak_memory_mb"] or 0) for r in summary),
    }


def synthetic_rows(out: Path, a: float) -> dict[int, dict]:
    """The speculative rows of a run at synthetic acceptance ``a``, by K: the speedup it measured against
    the one that the formula predicts from the run's own forward costs (predicted.csv at alpha = a)."""
    from specbench.core.metrics import expected_tokens

    records = [r for r in read_csv(out / "records.csv") if r["method"] == "speculative"]
    predicted = {
        int(r["k"]): float(r["predicted_speedup_verify"]) for r in read_csv(out / "predicted.csv") if r["alpha"] == a
    }
    rows = {}
    for row in (r for r in read_csv(out / "summary.csv") if r["method"] == "speculative"):
        k = int(row["k"])
        at = [r for r in records if int(r["k"]) == k]
        rows[k] = {
            "expected_tokens": expected_tokens(a, k),
            # the prefill's forward yields the first token; each round's verification the rest
            "tokens_per_round": sum(r["new_tokens"] - 1 for r in at) / sum(r["target_forwards"] - 1 for r in at),
            "predicted_speedup_verify": predicted[k],
            "decode_speedup": float(row["decode_speedup"]),  # prefill left out on both sides, as the formula
            "speedup": float(row["speedup"]),  # end to end
            "share_of_predicted": float(row["decode_speedup"]) / predicted[k],
        }
    return rows


def mission_goals(graphs: dict, synthetic: dict) -> list[dict]:
    """Issue 72's goals for the static path from step c's figures: its column (``graphs``) and its
    synthetic rows."""
    mbu, c = graphs["mbu"], graphs["c"]
    limit, most = VERIFY_GOAL
    ratios = {k: r for k, r in graphs["verify_ratio"].items() if k <= most}
    worst = max(ratios, key=ratios.get)
    a, k, least, share = SPEEDUP_GOAL
    row = synthetic[f"{a} K={k}"]
    return [
        issue_goal(
            f"the baseline at >= {MBU_GOAL:.0%} of the measured copy bandwidth",
            f"MBU {percent(mbu)}",
            None if mbu is None else mbu >= MBU_GOAL,
        ),
        issue_goal(f"c <= {C_GOAL}", f"{c:.3f}", c <= C_GOAL),
        issue_goal(
            f"verify ratio <= {limit:.2f} at K <= {most}",
            f"at most {ratios[worst]:.2f} (K = {worst})",
            ratios[worst] <= limit,
        ),
        issue_goal(
            f"at synthetic acceptance {a} and K = {k}, a measured speedup >= {least}x",
            f"{row['decode_speedup']:.2f}x (prefill left out; {row['speedup']:.2f}x end to end)",
            row["decode_speedup"] >= least,
        ),
        issue_goal(
            f"... and >= {share} of the prediction from measured costs",
            f"{row['share_of_predicted']:.2f} of {row['predicted_speedup_verify']:.2f}x",
            row["share_of_predicted"] >= share,
        ),
    ]


def mission_report(check: Check, columns: dict, synthetic: dict) -> list[str]:
    """Step c's section: a column per route, the predictions, and the synthetic runs' speedups."""
    s, g = check.sizes, columns["graphs"]
    names = {"graphs": "--graphs", **{route: " ".join(flags) for route, flags in COMPARED.items()}}
    weights = in_bytes(g["weight_bytes"]) if g["weight_bytes"] else "-"
    bandwidth = f"{g['copy_bandwidth_gbs']:,.0f} GB/s" if g["copy_bandwidth_gbs"] else "-"
    rows = [
        f"{Path(s.pair[0]).stem} <- {Path(s.pair[1]).stem}, bfloat16, random weights: a target step reads {weights} of "
        f"weights; copy bandwidth {bandwidth} (each run's own). The {g['route']} column is {g['run']}'s run, "
        f"{plural(s.graph_prompts, 'prompt')} of {s.prompt_tokens} random tokens, {s.graph_tokens} new tokens, K "
        f"{','.join(map(str, SYNTHETIC_KS))} (acceptance set by hand changes no cost); "
        + (
            f"the others {plural(s.prompts, 'prompt')}, {s.tokens} new tokens, K {COMPARED_K}."
            if len(columns) > 1
            else "the compiled and eager forwards were not run (--routes graphs)."
        ),
        "",
        "| | " + " | ".join(f"{columns[r]['route']} ({names[r]})" for r in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]

    def line(label: str, cell: Callable[[dict], str]) -> None:
        rows.append(f"| {label} | " + " | ".join(cell(col) for col in columns.values()) + " |")

    line("run (its log times each stage)", lambda x: x["run"])
    line("forward: target / draft", lambda x: f"{x['route']} / {x['draft_route']}")
    line("baseline tokens/s (prefill included)", lambda x: f"{x['baseline_tokens_per_s']:.1f}")
    line("baseline decode tokens/s (prefill left out)", lambda x: f"{x['decode_tokens_per_s']:.1f}")
    line("model bandwidth utilisation (baseline_mbu)", lambda x: percent(x["mbu"]))
    line("c (draft step / target step)", lambda x: f"{x['c']:.3f}")
    for k in SHOWN_KS:
        line(f"verify ratio, K = {k} ({k + 1} tokens)", lambda x, k=k: fmt(x["verify_ratio"].get(k)))
    line("peak memory (MB)", lambda x: f"{x['peak_memory_mb']:.0f}")
    line("forwards built in (s): target + draft", lambda x: " + ".join(f"{t:.1f}" for t in x["build_s"].values()))
    line(
        "CUDA graphs captured: target + draft, in (s), their outputs",
        lambda x: (
            f"{' + '.join(str(len(n)) for n in x['graphs'].values())} in {x['capture_s']:.1f}, {x['graphs_mb']:.0f} MB"
            if x["capture_s"]
            else "-"
        ),
    )
    line("the whole run (s)", lambda x: f"{x['run_s']:.0f}")
    rows += ["", "| K | " + " | ".join(f"predicted at alpha {a}" for a in ALPHAS) + " |"]
    rows += ["|---|" + "---|" * len(ALPHAS)]
    for k in SHOWN_KS:
        cells = (
            " / ".join(fmt(x["predicted_speedup_verify"].get(f"{a} K={k}")) for x in columns.values()) for a in ALPHAS
        )
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    routes = " / ".join(x["route"] for x in columns.values())
    rows += [
        "",
        f"Each cell: {routes}. Predicted: E[tokens] / (K c + verify ratio), from the run's own forward costs",
        "(predicted.csv).",
        "",
        f"Acceptance set by hand on {g['route']} (--synthetic-acceptance a): each draft is kept with probability a",
        "while those before it were, so alpha is a, and the measured speedup can be held against the prediction.",
        "",
        "| a | K | tokens per round: measured / E[tokens] | predicted | measured, prefill left out | of predicted | "
        "measured end to end |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in synthetic.items():
        a, k = name.split(" K=")
        rows.append(
            f"| {a} | {k} | {x['tokens_per_round']:.2f} / {x['expected_tokens']:.2f} | "
            f"{x['predicted_speedup_verify']:.2f}x | {x['decode_speedup']:.2f}x | {x['share_of_predicted']:.2f} | "
            f"{x['speedup']:.2f}x |"
        )
    return rows


def value(x) -> float | None:
    """A CSV cell as a number, None where it is empty or NaN (not measured)."""
    x = number(x)
    return None if x is None or x != x else x


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def plural(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def in_bytes(n: float) -> str:
    """A byte count in decimal units, three figures: 13.5 GB, 1.31 MB."""
    unit, size = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= s), ("B", 1))
    return f"{n / size:.3g} {unit}"


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
        # As long as c's graph runs: the same cache size, so inductor's cache serves c's forwards.
        out = check.run(
            "d-tree-eagle", *s.pair, "--dtype", "bfloat16", "--graphs", "--k", "4", "--method", "tree,eagle",
            "--tree", "2,2", "--speculator", str(head), "--num-prompts", str(s.prompts), "--max-new-tokens",
            str(s.graph_tokens), "--prompt-tokens", str(s.prompt_tokens),
        )  # fmt: skip
    summary = {r["method"]: r for r in read_csv(out / "summary.csv")}
    missing = {"tree", "eagle"} - set(summary)
    if missing:
        raise StepFailed(f"no row for {', '.join(sorted(missing))} in {out.name}/summary.csv")
    if problem := route_problem(out, static_route(check)):
        raise StepFailed(problem)
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
    rows += ["target's forward over the round's nodes + 1 over its one-token forward. Forward: "]
    rows[-1] += f"{static_route(check)} (--graphs)."
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
    from specbench.drafters.trees import TreeDrafter
    from specbench.models.load import random_model
    from specbench.models.static import StaticLM
    from tests.helpers import HostReads

    device = torch.device(check.sizes.device)

    def static(m) -> StaticLM:
        """``m`` on CUDA's default route, the static path, its forwards graphed; on the dry run's CPU
        uncompiled (route static), as tests/decoding/test_syncs.py counts it there: reads inside
        compiled code would be inductor's own, not the loop's."""
        lm = StaticLM.of(m.model, m.width, compiled=device.type == "cuda")
        lm.reserve(128)  # the prompt, 40 tokens and a round of K = 3
        return lm

    target, draft = (
        static(random_model(spec, device, torch.float32, seed=i)) for i, spec in enumerate(check.sizes.greedy_pair)
    )
    prompt = torch.tensor([5, 9, 14, 5, 9, 14, 5, 9, 3, 7, 5, 9], device=device)  # repeats: lookup finds matches
    rows = ["| decode | rounds | host reads | per round | CUDA syncs | per round |", "|---|---|---|---|---|---|"]
    figures, problems = {}, []
    kinds = ("draft model", "draft tree 2,2", "prompt lookup", "baseline")
    cases = [(f"{d}, T={t}", d, t) for d in kinds for t in (0.0, 1.0)]

    def decode(drafting: str, sampling: Sampling, generator: torch.Generator):
        if drafting == "baseline":
            return autoregressive_decode(target, prompt, 40, sampling, generator)
        if drafting == "draft model":
            drafter = ModelDrafter(draft, sampling, generator)
        elif drafting == "draft tree 2,2":
            drafter = TreeDrafter(draft, sampling, generator, (2, 2))
        else:
            drafter = PromptLookupDrafter()
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
        # The baseline's unit is a read every STOP_CHECK tokens; a round's (a chain's or a tree's) is one read.
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
    pair = " <- ".join(Path(m).stem for m in check.sizes.greedy_pair)
    rows += [
        "",
        "Host reads as tests/decoding/test_syncs.py counts them (item, tolist, .cpu(), bool(), multinomial, ...);",
        "CUDA syncs: the calls that torch.cuda.set_sync_debug_mode('warn') flagged. The baseline's row counts",
        f"tokens (it reads once every {STOP_CHECK}). Each decode: 40 tokens, K = 3, {pair} on the {target.route} route",
        "(the static path), counted on its second run (the first compiles the forwards and captures their graphs).",
    ]
    figures["route"] = target.route
    chain = figures["draft model, T=1.0"]
    line = f"draft model T=1: {chain['host_reads']} reads in {chain['rounds']} rounds" + (
        f", {chain['cuda_syncs']} CUDA syncs" if device.type == "cuda" else ""
    )
    if problems:  # the table still goes in the report: it says where the reads are
        return Outcome("FAIL", "; ".join(problems), rows, figures)
    return Outcome("pass", line, rows, figures)


# ---------------------------------------------------------------- f. where a step's time goes


def step_profile(check: Check) -> Outcome:
    """benchmarks/step_profile.py on step c's pair and sizes, in a process of its own (its 7B leaves
    with it): the replay, kernels, loop, synced and host times of each model's step."""
    s = check.sizes
    out = check.folder / "f-profile"
    args = ["-m", "benchmarks.step_profile", "--target", s.pair[0], "--draft", s.pair[1], "--dtype", "bfloat16"]
    args += ["--device", s.device, "--prompt-tokens", str(s.prompt_tokens), "--new-tokens", str(s.graph_tokens)]
    check.command("f-profile", [*args, "--k", "4", "--out", str(out)])
    result = json.loads((out / "step-profile.json").read_text())
    target, draft = result["models"]["target"]["sizes"]["1"], result["models"]["draft"]["sizes"]["1"]
    drafted = result["models"]["draft"]["drafted_us"]

    def both(row: dict) -> str:
        replay = "no graph" if row["replay_us"] is None else f"replay {row['replay_us']:,.0f}"
        return f"{replay}, loop {row['loop_us']:,.0f}, synced {row['synced_us']:,.0f} us"

    summary = (
        f"target {both(target)}; draft {both(draft)}; drafted token {drafted['greedy']:,.0f} us greedy, "
        f"{drafted['sampled']:,.0f} sampled"
    )
    details = (out / "step-profile.md").read_text().splitlines()
    return Outcome("pass", summary, details, result)


# In the order they run (but b and e, beside a): f before d, so that a lease that ends early keeps the
# figures the next change to the static path starts from, rather than the tree's and the head's.
STEPS: list[tuple[str, str, Callable[[Check], Outcome]]] = [
    ("a", "the tests marked gpu", gpu_tests),
    ("b", "greedy equality on the static path", greedy),
    ("c", "the mission's pair shape", mission),
    ("f", "where a step's time goes", step_profile),
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
    from specbench.core.machine import driver_version, machine, source_revision

    commit, changed = source_revision()
    source = "git unknown" if commit is None else f"git {commit[:7]}"
    if changed:
        source += f", {changed} tracked files changed since"
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
        ("specbench", f"{specbench.__version__} ({source})"),
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
    goals = [{"step": key, **g} for key, _, outcome, _ in results for g in outcome.goals]
    if goals:
        lines += ["", "Issue 72's goals for the static path (reported; a goal not met fails no step):", ""]
        lines += ["| goal | step | measured | |", "|---|---|---|---|"]
        for g in goals:
            verdict = "**not met**" if g["verdict"] == "not met" else g["verdict"]
            lines.append(f"| {g['goal']} | {g['step']} | {g['measured']} | {verdict} |")
    for key, name, outcome, _ in results:
        lines += ["", f"## {key}. {name}", "", *outcome.details]
    (folder / "gpu-check.md").write_text("\n".join(lines) + "\n")
    figures = {f"{key}. {name}": {"status": o.status, "seconds": s, **o.figures} for key, name, o, s in results}
    whole = {"machine": dict(machine), "seconds": elapsed, "goal_s": goal, "goals": goals, "steps": figures}
    (folder / "gpu-check.json").write_text(json.dumps(whole, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the same steps on the CPU at toy sizes")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="where the check's folder goes")
    parser.add_argument("--wheels", type=Path, help="install missing dependencies from this wheel folder")
    parser.add_argument("--steps", default="abcdef", help="which steps to run (letters), default all")
    parser.add_argument("--step-timeout", type=int, help="seconds for every step, instead of each one's own")
    parser.add_argument(
        "--routes",
        default="graphs," + ",".join(COMPARED),
        help="the forwards step c times: graphs, and beside them compiled and eager unless left out (a short "
        "lease's --routes graphs spares their two 7B runs)",
    )
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
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if "graphs" not in routes or set(routes) - {"graphs", *COMPARED}:
        print(f"gpu-check: --routes takes graphs and any of {', '.join(COMPARED)}, not {args.routes}")
        return 2
    unknown = set(args.steps) - {key for key, _, _ in STEPS}
    if unknown:
        print(
            f"gpu-check: --steps takes letters of {''.join(sorted(k for k, _, _ in STEPS))}, not {''.join(sorted(unknown))}"
        )
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
    if args.dry:
        torch.set_num_threads(1)  # as every run's --threads 1 (Sizes.run_options): step e shares the CPU with a's tests

    from rich.console import Console

    from specbench.models.costs import copy_bandwidth  # what `specbench run` measures for baseline_mbu

    console = Console(stderr=True)
    bandwidth = copy_bandwidth(sizes.device)
    machine = machine_rows(args.dry, bandwidth, packages)
    title = f"{device_name}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    console.print(f"gpu-check on {title} -> {folder}")
    for key, value in machine:
        console.print(f"  {key}: {value}")
    check = Check(folder, sizes, args.dry, env, bandwidth, compared=tuple(r for r in COMPARED if r in routes))
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
