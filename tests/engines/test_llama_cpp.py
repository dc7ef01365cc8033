"""--engine llama-cpp against real llama-servers on 127.0.0.1, started and stopped by specbench: the
default target (SmolLM2-135M, its own Q4_1 GGUF) and the shipped draft, converted to GGUF by
llama.cpp's own converter into the test session's cache. They need the llama-server of `make
install-llama-cpp` ($LLAMA_CPP_DIR) and run in `make test-llama-cpp` and CI, as the vLLM tests run
in theirs. What needs no llama-server (options, commands, the binary's lookup) is tested at the end
without the marker."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from specbench.core.errors import SpecbenchError
from specbench.engines import llamacpp

from ..helpers import cli, one_line_error, processes

ENGINE = ["--engine", "llama-cpp", "--warmup", "0", "--num-prompts", "3", "--max-new-tokens", "24"]
# The greedy tests decode f32 GGUF files: on the target's own Q4_1 file llama.cpp's speculating
# servers answer otherwise than its plain one (docs/audit.md), while at f32 they agree.
EXACT = ["--gguf-type", "f32"]
TAG = "SPECBENCH_TEST_TAG"
ACCEPTED = re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)")


@pytest.fixture
def in_cache(llama_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBENCH_CACHE", str(llama_cache))
    # Every process the test starts inherits this tag, so that running_servers tells the test's
    # llama-servers from those of a test running beside it.
    monkeypatch.setenv(TAG, str(tmp_path))


@pytest.mark.llama_cpp
def test_rows_acceptance_from_the_servers_and_greedy_outputs_equal(in_cache, tmp_path):
    out = tmp_path / "run"
    result = cli("run", *ENGINE, *EXACT, "--method", "draft,ngram", "--k", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "time per generated token" not in result.stdout  # no phases for a server's rows
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert list(summary.index) == ["baseline", "draft-greedy", "draft-probabilistic", "ngram-simple"]
    assert (summary["engine"] == "llama-cpp").all() and (summary["failed"] == 0).all()
    # Greedy: every request of every server equals the baseline server's.
    assert (summary["outputs_match"] == 3).all() and (summary.drop("baseline")["structural"] == 0).all()
    for method in ("draft-greedy", "draft-probabilistic"):
        row = summary.loc[method]
        assert row["acceptance_source"] == "response" and row["tau"] > 1 and row["c"] > 0
        # What the rows say was drafted and accepted is what the server's own log counted, request
        # by request (no warm-up: every request in the log is one of the rows').
        counted = ACCEPTED.findall((out / "servers" / f"{method}-k2.log").read_text())
        assert len(counted) == 3
        assert row["accepted"] == sum(int(a) for a, _ in counted)
        assert row["drafted"] == sum(int(d) for _, d in counted)
    assert (
        "spec_type=draft-simple,draft_sampling=probabilistic,gguf=f32" in summary.loc["draft-probabilistic", "options"]
    )
    costs = pd.read_csv(out / "engine_costs.csv")
    assert set(costs["model"]) == {"target", "draft"} and (costs["engine"] == "llama-cpp").all()
    assert not list((out / "servers").glob("*.partial*")) and not running_servers(tag=tmp_path)


@pytest.mark.llama_cpp
def test_a_baseline_killed_mid_run_keeps_its_rows_and_resume_finishes(in_cache, tmp_path):
    out = tmp_path / "killed"
    # Long enough that the kill, made as soon as two rows are on disk, lands inside the baseline's block.
    args = [*ENGINE, "--num-prompts", "6", "--max-new-tokens", "48", "--method", "ngram", "--k", "2"]
    args += ["--out", str(out)]
    running = subprocess.Popen(
        [sys.executable, "-m", "specbench", "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    records = out / "records.csv"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (records.is_file() and len(records.read_text().splitlines()) >= 3):
        time.sleep(0.1)
    servers = running_servers(running.pid)
    assert len(servers) == 1  # the baseline's
    os.kill(servers[0], signal.SIGKILL)
    _, stderr = running.communicate(timeout=300)
    assert running.returncode != 0 and "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--resume" in " ".join(stderr.split()), stderr[-2000:]
    kept = pd.read_csv(records, keep_default_na=False)
    assert (kept["error"] == "").sum() >= 2  # the rows finished before the kill are on disk
    assert set(kept["method"]) == {"baseline"} and (kept["error"] == "").sum() < 6  # killed inside its block
    result = cli("run", *args, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = pd.read_csv(records, keep_default_na=False)
    assert len(rows[(rows["method"] == "baseline") & (rows["error"] == "")]) == 6
    assert len(rows[rows["method"] == "ngram-simple"]) == 6


@pytest.mark.llama_cpp
def test_the_audit_of_llama_cpp_gives_greedy_verdicts_for_both_draft_modes(in_cache, tmp_path):
    args = ["--engine", "llama-cpp", "--method", "draft", "--k", "2", "--num-prompts", "2", "--prompts", "1"]
    args += ["--setting", "greedy", "--greedy-tokens", "32", *EXACT, "--out", str(tmp_path / "audit")]
    result = cli("audit", *args)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    report = json.loads((tmp_path / "audit" / "audit.json").read_text())
    verdicts = {(r["subject"], r["test"]): r["verdict"] for r in report["rows"]}
    for subject in ("llama-cpp draft-greedy K=2", "llama-cpp draft-probabilistic K=2"):
        assert verdicts[(subject, "greedy")] == "pass"
        # llama-server gives a token of a speculative round logprob 0 and no alternatives
        # (server-context.cpp: "TODO: set result.probs"): the probe fails, and so does the audit.
        assert verdicts[(subject, "logprobs")] == "FAIL"
    failed = {key for key, verdict in verdicts.items() if verdict == "FAIL"}
    assert {test for _, test in failed} == {"logprobs"}
    assert result.returncode == 1, result.stderr[-3000:]


@pytest.mark.llama_cpp
def test_a_launched_llama_server_per_k_gives_rows_per_k(in_cache, llama_cache, tmp_path):
    """--engine server with the user's own llama-server command lines: --launch spec=... with {k} (and
    {draft}) starts a draft-simple server for each K in turn, on loopback; rows, logs and acceptance
    come per K, each K's as its own server counted it."""
    from specbench.core.options import DEFAULT_DRAFT, DEFAULT_TARGET
    from specbench.models.names import resolve

    server = llamacpp.find_server()
    draft = llamacpp.gguf_of(Path(resolve(DEFAULT_DRAFT).location), "f32", server, llama_cache / "gguf")
    plain = f"{server} -m {resolve(DEFAULT_TARGET).location} --host 127.0.0.1 --port {{port}} -c 512 --top-k 0 -t 1"
    spec = f"{plain} --spec-type draft-simple --spec-draft-model {{draft}} --spec-draft-n-max {{k}}"
    args = ["run", "--engine", "server", "--target", DEFAULT_TARGET, "--draft", str(draft), "--k", "1,2,3,4"]
    args += [
        "--launch",
        f"baseline={plain}",
        "--launch",
        f"spec={spec}",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "24",
    ]
    result = cli(*args, "--warmup", "0", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run"
    summary = pd.read_csv(out / "summary.csv")
    spec_rows = summary[summary["method"] == "spec"].astype({"k": int}).set_index("k")
    assert sorted(spec_rows.index) == [1, 2, 3, 4] and (summary["failed"] == 0).all()
    for k, row in spec_rows.iterrows():
        log = (out / "servers" / f"spec-k{k}.log").read_text()
        counted = ACCEPTED.findall(log)
        assert len(counted) == 2 and row["acceptance_source"] == "response"
        assert row["accepted"] == sum(int(a) for a, _ in counted) and row["drafted"] == sum(int(d) for _, d in counted)
    assert sorted(p.name for p in (out / "servers").iterdir()) == ["baseline.log"] + [
        f"spec-k{k}.log" for k in (1, 2, 3, 4)
    ]
    assert not running_servers(tag=tmp_path)


def running_servers(parent: int | None = None, tag: Path | None = None) -> list[int]:
    """The pids of llama-server processes: children of ``parent``, or started under the test ``tag``."""
    return [
        pid
        for pid, ppid, argv, environ in processes()
        if Path(argv[0].decode(errors="replace")).name == "llama-server"
        and (parent is None or ppid == parent)
        and (tag is None or f"{TAG}={tag}".encode() in environ)
    ]


# ---------------------------------------------------------------- without a llama-server


def test_the_binary_is_found_by_flag_directory_or_path_and_else_one_line(tmp_path, monkeypatch):
    binary = tmp_path / "built" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "built"))
    assert llamacpp.find_server() == binary.resolve()
    assert llamacpp.find_server(str(binary.parent)) == binary.resolve()
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "empty"))
    with pytest.raises(SpecbenchError, match="make install-llama-cpp"):
        llamacpp.find_server()
    monkeypatch.setenv("PATH", str(binary.parent))
    assert llamacpp.find_server() == binary.resolve()
    with pytest.raises(SpecbenchError, match="--llama-server"):
        llamacpp.find_server(str(tmp_path / "nowhere"))


@pytest.mark.llama_cpp
def test_synthetic_acceptance_reaches_the_llama_server_and_sets_its_acceptance(in_cache, tmp_path):
    out = tmp_path / "run"
    args = ["--method", "draft", "--draft-sampling", "greedy", "--k", "2", "--synthetic-acceptance", "0.2"]
    result = cli("run", *ENGINE, *args, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not compared (--synthetic-acceptance" in result.stdout
    log = (out / "servers" / "draft-greedy-k2.log").read_text()
    assert "rates = [0.2, 0.04]" in log  # llama.cpp's own account of what it was started with
    row = pd.read_csv(out / "summary.csv").set_index("method").loc["draft-greedy"]
    # Kept at 0.2 then 0.04: 0.12 of the drafts, where the draft's own acceptance here is above 0.5.
    assert row["synthetic_acceptance"] == 0.2 and row["acceptance_rate"] < 0.3 and row["tau"] < 1.5
    assert pd.isna(row["outputs_match"]) and pd.isna(row["structural"])  # not the target's outputs: not counted


def test_each_server_command_speculates_as_its_method_says(tmp_path):
    server, target, draft = Path("/x/llama-server"), Path("/m/t.gguf"), Path("/m/d.gguf")
    base = llamacpp.command(server, target, 4, 300)
    assert "--spec-type" not in base and "-np 4 -c 1200 --metrics" in base and "--port {port}" in base
    assert "--top-k 0 --top-p 1 --min-p 0" in base  # llama-server's own sampling defaults made neutral
    drafted = llamacpp.command(server, target, 1, 300, llamacpp.Speculation("draft-simple", 3, draft, "probabilistic"))
    assert "--spec-type draft-simple --spec-draft-n-max 3 --spec-draft-model /m/d.gguf" in drafted
    assert "--spec-draft-sampling probabilistic" in drafted
    synthetic = llamacpp.Speculation("draft-simple", 2, draft, synthetic=(0.5, 0.25))
    assert "--spec-synth-rates 0.5,0.25" in llamacpp.command(server, target, 1, 300, synthetic)
    ngram = llamacpp.command(server, target, 1, 300, llamacpp.Speculation("ngram-simple", 4))
    assert "--spec-ngram-simple-size-m 4 --spec-ngram-simple-size-n 3" in ngram and "--spec-draft-model" not in ngram
    # A draft shorter than the n-gram it matched is dropped by llama.cpp: at K = 2 it matches 2.
    short = llamacpp.command(server, target, 1, 300, llamacpp.Speculation("ngram-simple", 2))
    assert "--spec-ngram-simple-size-m 2 --spec-ngram-simple-size-n 2" in short


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--engine", "llama-cpp", "--method", "tree"], "does not run in llama.cpp"),
        (["--engine", "llama-cpp,torch"], "runs alone"),
        (["--gguf-type", "f16"], "add --engine llama-cpp"),
        (["--engine", "llama-cpp", "--llama-server", "/nonexistent/llama-server"], "make install-llama-cpp"),
        (["--engine", "llama-cpp", "--random-weights"], "llama.cpp needs the weights"),
    ],
)
def test_bad_llama_cpp_input_is_one_line(args, needle, tmp_path):
    one_line_error(cli("run", *args, "--out", str(tmp_path / "out")), needle)
