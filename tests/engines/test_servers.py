"""--engine server against stub servers on 127.0.0.1 (benchmarks/stub_server.py), started and stopped by
each test: the response shapes of vLLM, llama.cpp, SGLang and TensorRT-LLM, every fault a server can
have, and an API key that must not leak. The tests against real vLLM servers are in test_vllm.py."""

import gc
import json
import math
import random
import sys

import pandas as pd
import pytest

from benchmarks.stub_server import Stub, answer, steps_of
from specbench.audit.run import Arm, Group
from specbench.audit.verdicts import probe_rows
from specbench.decoding.sampling import Sampling
from specbench.engines import arrivals
from specbench.engines.server import Reply, Server, parse_counters

from ..helpers import cli, one_line_error, specbench


def run_servers(tiny_pair, out, baseline, *servers, extra=(), env=None, timeout=300):
    args = ["run", "--engine", "server", "--target", tiny_pair[0], "--baseline-url", baseline.url]
    for name, stub in servers:
        args += ["--server", f"{name}={stub.url}"]
    return specbench(*args, "--max-new-tokens", "12", "--warmup", "0", "--out", str(out), *extra, timeout=timeout)


def test_each_server_shape_gives_its_rows_acceptance_and_source(tiny_pair, spec_bench_file, tmp_path):
    with (
        Stub(interval_s=0.002) as base,
        Stub("vllm", k=2, interval_s=0.002) as vllm,
        Stub("llamacpp", k=3, interval_s=0.002) as llama,
        Stub("sglang", k=2, interval_s=0.002) as sglang,
        Stub("trtllm", k=2, interval_s=0.002) as trt,
    ):
        result = run_servers(
            tiny_pair, tmp_path, base, ("vllm", vllm), ("llama", llama), ("sglang", sglang), ("trt", trt),
            extra=("--dataset", spec_bench_file, "--concurrency", "1,2", "--max-turns", "2"),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        vllm_counters = dict(vllm.counters)
    summary = pd.read_csv(tmp_path / "summary.csv")
    records = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
    turns = 10 + 6  # ten questions, six of them with a second turn
    assert len(records) == 5 * 2 * turns and set(records["engine"]) == {"server"}
    assert sorted(set(zip(summary["method"], summary["concurrency"], strict=True))) == sorted(
        (m, n) for m in ("baseline", "vllm", "llama", "sglang", "trt") for n in (1, 2)
    )
    source = dict(zip(summary["method"], summary["acceptance_source"].fillna(""), strict=False))
    assert source == {"baseline": "", "vllm": "response", "llama": "response", "sglang": "response", "trt": "counters"}
    # Every stub answers a prompt alike: all outputs equal the baseline's, turn by turn.
    spec = summary[summary["method"] != "baseline"]
    assert (spec["outputs_match"] == spec["num_prompts"]).all() and (spec["first_divergence"] == -1).all()
    assert (summary["failed"] == 0).all()
    # Where each server stops paying as the load grows: read from results.json's speedup intervals,
    # one entry per server, shown in the table's caption; the trade-off figure beside it.
    found = json.loads((tmp_path / "crossover.json").read_text())
    intervals = {
        (r["method"], r["concurrency"]): r["speedup_ci"]
        for r in json.loads((tmp_path / "results.json").read_text())["summary"]
    }
    assert sorted(entry["method"] for entry in found) == ["llama", "sglang", "trt", "vllm"]
    for entry in found:
        assert entry["axis"] == "concurrency" and [p["load"] for p in entry["points"]] == [1, 2]
        paying = [intervals[(entry["method"], n)][0] > 1.0 for n in (1, 2)]
        assert entry["crossover"] == (None if all(paying) else [1, 2][paying.index(False)])
    assert "pays at every load up to 2 in flight" in result.stdout or "in flight (its speedup" in result.stdout
    assert (tmp_path / "pareto.png").is_file()
    # The per-request figures of the vLLM-shaped stub sum to exactly what its own counters say.
    row = spec[spec["method"] == "vllm"]
    assert row["accepted"].sum() == vllm_counters["num_accepted_tokens"]
    assert row["drafted"].sum() == vllm_counters["num_draft_tokens"]
    assert set(row["k"]) == {2}  # K as the server says it
    # SGLang's verify count and TensorRT-LLM's counters give tau = tokens per target forward.
    tokens = int(records[(records["method"] == "sglang")]["new_tokens"].astype(int).sum())
    forwards = 2 * sum(len(steps_of(n, 2)) for n in [12] * turns)
    assert spec[spec["method"] == "sglang"]["tau"].sum() == pytest.approx(2 * tokens / forwards)
    trt_row = spec[(spec["method"] == "trt") & (spec["concurrency"] == 1)].iloc[0]
    assert trt_row["tau"] == pytest.approx(12 * turns / (len(steps_of(12, 2)) * turns))
    # A second turn's prompt holds this server's own first answer to the same conversation.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    said = [tokenizer.decode(b["prompt"]) for b in llama.bodies]
    seconds = [text for text in said if "now call" in text]
    assert len(seconds) == 2 * 6
    for text in seconds:
        question = text.split("now call")[0]
        first = next(b for b, t in zip(llama.bodies, said, strict=True) if "now call" not in t and t in question)
        assert f"w{answer(first['prompt'], 12)[0]} w{answer(first['prompt'], 12)[1]}" in text
    # Latency columns are filled, and the category table has every category.
    assert (summary["itl_p50_ms"] > 0).all() and (summary["e2e_p99_ms"] >= summary["e2e_p50_ms"]).all()
    categories = pd.read_csv(tmp_path / "categories.csv")
    assert {"writing", "roleplay", "reasoning", "translation", "summarization"} <= set(categories["category"])
    assert (spec["c_implied"].notna()).all() and spec["c"].isna().all()  # no --draft-url: no measured c


@pytest.mark.parametrize(("margin", "kind", "structural"), [(0.01, "near-tie", 0), (2.0, "structural", 3)])
def test_outputs_that_differ_are_caught_and_labelled(tiny_pair, prompts_file, tmp_path, margin, kind, structural):
    # The baseline's two likeliest tokens at the divergence are `margin` nats apart: a near-tie
    # below serving.NEAR_TIE, a structural divergence above it.
    with Stub(margin=margin) as base, Stub(k=2, diverge_at=5) as broken:
        result = run_servers(tiny_pair, tmp_path, base, ("broken", broken), extra=("--dataset", prompts_file))
    assert result.returncode == 0, result.stderr
    row = pd.read_csv(tmp_path / "summary.csv").set_index("method").loc["broken"]
    assert row["outputs_match"] == 0 and row["first_divergence"] == 5 and row["structural"] == structural
    records = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
    assert list(records[records["method"] == "broken"]["divergence"]) == [kind] * 3
    assert set(records[records["method"] == "baseline"]["divergence"]) == {""}


def test_the_draft_url_gives_c(tiny_pair, prompts_file, tmp_path):
    with Stub(interval_s=0.01) as base, Stub(k=2, interval_s=0.01) as spec, Stub(interval_s=0.002) as draft:
        result = run_servers(
            tiny_pair, tmp_path, base, ("spec", spec), extra=("--dataset", prompts_file, "--draft-url", draft.url)
        )
    assert result.returncode == 0, result.stderr
    costs = pd.read_csv(tmp_path / "engine_costs.csv").set_index("model")
    assert set(costs.index) == {"target", "draft"}
    c = pd.read_csv(tmp_path / "summary.csv").set_index("method").loc["spec", "c"]
    assert c == pytest.approx(costs.loc["draft", "tpot_ms"] / costs.loc["target", "tpot_ms"])
    assert 0.05 < c < 0.6  # 2 ms a chunk against 10 ms


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("http500", "HTTP 500"), ("slow", "no complete answer within 2 s"), ("drop", "the stream ended before")],
)
def test_a_failing_server_has_its_requests_recorded_as_failed(tiny_pair, prompts_file, tmp_path, fault, reason):
    with Stub() as base, Stub(k=2, fault=fault) as bad:
        result = run_servers(
            tiny_pair, tmp_path, base, ("bad", bad), extra=("--dataset", prompts_file, "--request-timeout", "2")
        )
    assert result.returncode == 0, result.stderr
    records = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
    bad_rows = records[records["method"] == "bad"]
    assert len(bad_rows) == 3 and all(reason in e for e in bad_rows["error"])
    summary = pd.read_csv(tmp_path / "summary.csv").set_index("method")
    assert summary.loc["bad", "failed"] == 3 and summary.loc["baseline", "failed"] == 0
    assert summary.loc["baseline", "num_prompts"] == 3


def test_an_unreachable_server_fails_its_requests_and_an_unreachable_baseline_stops_in_one_line(
    tiny_pair, prompts_file, tmp_path
):
    gone = Stub()  # never started: nothing listens on its port
    with Stub() as base:
        result = run_servers(tiny_pair, tmp_path / "a", base, ("gone", gone), extra=("--dataset", prompts_file))
    assert result.returncode == 0, result.stderr
    assert "not reachable" in " ".join(result.stderr.split())
    summary = pd.read_csv(tmp_path / "a" / "summary.csv").set_index("method")
    assert summary.loc["gone", "failed"] == 3
    with Stub(k=2) as spec:
        result = run_servers(tiny_pair, tmp_path / "b", gone, ("spec", spec), extra=("--dataset", prompts_file))
    one_line_error(result, "--baseline-url", "baseline", "not reachable", "start it")
    assert not (tmp_path / "b").exists()  # found before any model was loaded or any folder made


def test_a_baseline_that_dies_mid_run_keeps_the_rows_and_resume_finishes(tiny_pair, prompts_file, tmp_path):
    extra = ("--dataset", prompts_file, "--concurrency", "1,2")
    with Stub(die_after=4) as base, Stub(k=2) as spec:  # 3 prompts at concurrency 1, then one more
        result = run_servers(tiny_pair, tmp_path, base, ("spec", spec), extra=extra)
        one_line_error(result, "baseline", "--resume")
        kept = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
        assert (kept["error"] == "").sum() == 4  # the finished rows are on disk
        base.die_after = None
        result = run_servers(tiny_pair, tmp_path, base, ("spec", spec), extra=(*extra, "--resume"))
    assert result.returncode == 0, result.stderr
    records = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
    assert len(records) == 2 * 2 * 3 and (records["error"] == "").all()
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert len(summary) == 4 and (summary["failed"] == 0).all()


def test_the_api_key_reaches_the_server_and_nothing_else(tiny_pair, prompts_file, tmp_path):
    secret = "sk-test-" + "".join(random.choice("abcdef0123456789") for _ in range(24))
    env_name = "SPECBENCH_TEST_KEY"
    with Stub(key=secret) as base, Stub(k=2, key=secret) as spec:
        import os

        os.environ[env_name] = secret
        try:
            result = run_servers(
                tiny_pair,
                tmp_path / "run",
                base,
                ("spec", spec),
                extra=("--dataset", prompts_file, "--api-key-env", env_name),
            )
        finally:
            del os.environ[env_name]
        assert result.returncode == 0, result.stderr
        written = "".join(p.read_text(errors="ignore") for p in (tmp_path / "run").rglob("*") if p.is_file())
        assert secret not in written + result.stdout + result.stderr
        # Without the key the baseline refuses: one line that names the fix and not the key.
        result = run_servers(tiny_pair, tmp_path / "nokey", base, ("spec", spec), extra=("--dataset", prompts_file))
        one_line_error(result, "HTTP 401", "--api-key-env")


def test_chat_requests_carry_the_servers_own_first_answer(tiny_pair, spec_bench_file, tmp_path):
    with Stub() as base, Stub(k=2) as spec:
        result = run_servers(
            tiny_pair,
            tmp_path,
            base,
            ("spec", spec),
            extra=("--dataset", spec_bench_file, "--api", "chat", "--max-turns", "2"),
        )
        assert result.returncode == 0, result.stderr
        seconds = [b["messages"] for b in spec.bodies if len(b["messages"]) == 3]
    assert len(seconds) == 6
    for messages in seconds:
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["content"].startswith("w")  # the stub's own answer text, not the baseline's


def test_request_rate_sends_poisson_arrivals_and_labels_its_rows(tiny_pair, prompts_file, tmp_path):
    gaps = [b - a for a, b in zip(*(lambda t: (t, t[1:]))(arrivals(4000, 50.0, 1)), strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert arrivals(5, 50.0, 1) == arrivals(5, 50.0, 1) and arrivals(3, math.inf, 0) == [0.0] * 3
    with Stub() as base, Stub(k=2) as spec:
        result = run_servers(
            tiny_pair, tmp_path, base, ("spec", spec), extra=("--dataset", prompts_file, "--request-rate", "20,inf")
        )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert sorted(set(summary["request_rate"])) == [20.0, math.inf]


def test_a_load_over_a_hundred_has_every_request_in_flight():
    """aiohttp's session holds 100 connections at most unless told otherwise: 120 in flight must be 120."""
    sampling = Sampling(max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=())
    with Stub(gather=120) as stub, Server("stub", stub.url) as server:
        served = list(server.run([[1, 2, 3]] * 120, 120, sampling))
    assert [s.error for s in served] == [""] * 120
    assert stub.peak == 120


def test_the_heap_is_frozen_while_the_client_times_a_block_and_only_then():
    """A full collection of what existed before (torch, transformers) must not stop the thread that
    times the chunks: those objects are frozen for the block, and given back to the collector after."""
    sampling = Sampling(max_new_tokens=3, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=())
    frozen = []
    with Stub() as stub, Server("stub", stub.url) as server:
        before = gc.get_freeze_count()
        for served in server.run([[1, 2, 3]] * 3, 2, sampling):
            frozen.append(gc.get_freeze_count())
            assert not served.error
        assert gc.get_freeze_count() == before
    assert len(frozen) == 3 and min(frozen) > before


def test_counters_sum_over_engines_and_positions():
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0"} 10',
            'vllm:spec_decode_num_drafts_total{engine="1"} 5',
            "# TYPE vllm:spec_decode_num_drafts_created gauge",
            'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 8',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 4',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 3',
            "# TYPE vllm:num_requests_running gauge",
            "vllm:num_requests_running 2",
        ]
    )
    assert parse_counters(text + "\n") == {"num_drafts": 15.0, "num_accepted_tokens_per_pos": [12.0, 3.0]}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--engine", "server", "--server", "a=http://127.0.0.1:1/v1"], "--baseline-url"),
        (["--engine", "server", "--baseline-url", "http://127.0.0.1:1/v1"], "at least one server that speculates"),
        (["--engine", "server", "--baseline-url", "http://x/v1", "--server", "noequals"], "NAME=..."),
        (["--engine", "server", "--baseline-url", "http://x/v1", "--server", "a=ftp://x"], "--server a=ftp://x: give"),
        (
            ["--engine", "server", "--baseline-url", "notaurl", "--server", "a=http://y/v1"],
            "--baseline-url notaurl: give",
        ),
        (
            ["--engine", "server", "--baseline-url", "http://x/v1", "--draft-url", "x", "--server", "a=http://y/v1"],
            "--draft-url x: give",
        ),
        (["--engine", "server", "--baseline-url", "http://x/v1", "--server", "baseline=http://y/v1"], "not 'baseline'"),
        (["--engine", "torch,server"], "runs alone"),
        (["--server", "a=http://x/v1"], "add --engine server"),
        (["--request-rate", "5"], "serving engine"),
        (
            ["--engine", "server", "--baseline-url", "http://x/v1", "--server", "a=http://y/v1", "--request-rate", "0"],
            "above 0",
        ),
    ],
)
def test_bad_server_input_is_one_line(args, needle):
    one_line_error(cli("run", *args), needle)


def test_tokens_streamed_without_logprobs_keep_their_place_and_fail_the_probe():
    # llama-server streams every token of a speculative round with "logprobs": null.
    def chunk(text, logprob):
        logprobs = None if logprob is None else {"content": [{"token": text, "logprob": logprob, "top_logprobs": []}]}
        return ("data: " + json.dumps({"choices": [{"text": text, "logprobs": logprobs}]})).encode()

    subject, reference = Reply(), Reply()
    for text, mine, theirs in (("a", -0.5, -0.5), ("b", None, -0.2), ("c", -0.1, -0.1)):
        subject.take(chunk(text, mine), 0.0)
        reference.take(chunk(text, theirs), 0.0)
    assert subject.logprobs == [[-0.5], [], [-0.1]]  # aligned: "c" is compared with "c"
    who = {"subject": "s"}
    arm, ref = Arm("s", logprobs=subject.logprobs), Arm("r", logprobs=reference.logprobs)
    group = Group("r", [], [], None, (), ref, Arm("c"), [arm], [], {})
    row = next(r for r in probe_rows(group, arm, who) if r["test"] == "logprobs")
    assert row["verdict"] == "FAIL" and "no logprobs for 1 of 3 tokens" in row["evidence"]
    assert "largest gap 0 nats over 2 tokens" in row["evidence"]
    plain = Reply()
    plain.take(chunk("a", None), 0.0)
    assert plain.served(0, 0.0, 1.0, None).logprobs is None  # no logprobs asked for, none given


def test_a_launch_with_k_starts_a_server_per_k_and_a_resumed_sweep_keeps_each_finished_k(
    tiny_pair, prompts_file, tmp_path
):
    """--launch NAME=COMMAND with {k}: a server per --k, started, measured and stopped in turn, rows and
    logs by K. A server that cannot start at one K has its requests recorded as failed, naming its log,
    and the sweep goes on; --resume keeps the finished K and sends only what is missing."""
    # The stub pretends K drafts per step and says so (vLLM's num_spec_tokens); at K=3 it exits at once
    # until the file "mended" exists.
    stub = f"{sys.executable} -m benchmarks.stub_server --port {{port}} --shape vllm --k {{k}} --interval-ms 1"
    command = f"sh -c 'test {{k}} != 3 || test -e {tmp_path / 'mended'} || exit 7; exec {stub}'"
    args = ("--dataset", prompts_file, "--num-prompts", "2", "--k", "1,2,3", "--launch", f"spec={command}")
    with Stub(interval_s=0.001) as base:
        result = run_servers(tiny_pair, tmp_path, base, extra=args)
        assert result.returncode == 0, result.stderr[-2000:]
        said = " ".join(result.stderr.split())
        assert "--launch spec at K=3: the server exited with code 7: see" in said and "spec-k3.log" in said
        assert sorted(p.name for p in (tmp_path / "servers").iterdir()) == ["spec-k1.log", "spec-k2.log", "spec-k3.log"]
        records = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
        spec = records[records["method"] == "spec"]
        assert sorted(spec["k"].astype(int)) == [1, 1, 2, 2, 3, 3]
        fine = spec[spec["k"].astype(int) != 3]
        assert (fine["error"] == "").all() and (fine["acceptance_source"] == "response").all()
        assert (spec[spec["k"].astype(int) == 3]["error"].str.contains("spec-k3.log")).all()
        summary = pd.read_csv(tmp_path / "summary.csv")
        assert sorted(zip(summary["method"], summary["k"].fillna(0).astype(int), strict=True)) == [
            ("baseline", 0),
            ("spec", 1),
            ("spec", 2),
            ("spec", 3),
        ]
        # Resumed with a server that now starts at every K: only K=3's block is sent again.
        (tmp_path / "mended").touch()
        result = run_servers(tiny_pair, tmp_path, base, extra=(*args, "--resume"))
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = pd.read_csv(tmp_path / "records.csv", keep_default_na=False)
    assert len(resumed) == len(records) and (resumed["error"] == "").all()
    again = resumed[resumed["method"] == "spec"]
    finished = again[again["k"].astype(int) != 3]
    assert list(map(float, finished["method_s"])) == list(map(float, fine["method_s"]))  # kept, not sent again


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--launch", "spec=srv --port {port} --k {k}"], "--launch spec=...: {k} starts a server for each --k"),
        (["--k", "1,2", "--launch", "baseline=srv --port {port} {k}"], "the baseline server does not speculate"),
    ],
)
def test_a_launch_with_k_that_cannot_apply_is_one_line(tiny_pair, tmp_path, args, needle):
    base = ["run", "--engine", "server", "--target", tiny_pair[0], "--out", str(tmp_path / "run")]
    if "baseline=" not in args[-1]:
        base += ["--baseline-url", "http://127.0.0.1:9/v1"]
    else:
        base += ["--launch", "spec=srv --port {port}"]
    one_line_error(cli(*base, *args), needle)
    assert not (tmp_path / "run").exists()


def test_a_launched_server_logs_under_its_own_name(tiny_pair, prompts_file, tmp_path):
    # One server per --launch name (llama-cpp's per-K logs are NAME-kK; a launched server's is NAME).
    stub = f"{sys.executable} -m benchmarks.stub_server --port {{port}} --shape llamacpp --k 2 --interval-ms 1"
    with Stub(interval_s=0.001) as base:
        result = run_servers(
            tiny_pair, tmp_path, base, extra=("--dataset", prompts_file, "--num-prompts", "2", "--launch", f"lc={stub}")
        )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "servers").iterdir()) == ["lc.log"]
