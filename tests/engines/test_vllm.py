"""vLLM as an engine, on a tiny local pair: each test starts real engines (tens of seconds each), so
they are few, marked ``vllm`` and run by `make test-vllm` in the vLLM environment (.venv-vllm).
Without vLLM installed they fail with the install line: they never skip.

The runs go through the command line in this process (helpers.cli), where vLLM is imported once:
in a new interpreter each run imported it again, 13 s of CPU before its first engine started (the
tests took 598 CPU-s in-process against 710 as subprocesses, alone on 2 cores). Only what must be a
process of its own is one: vLLM's servers, and the server test's runs (it stops one mid-run)."""

import json

import pandas as pd
import pytest

from tests.helpers import (
    audit_workload,
    build_llama,
    build_thinking_pair,
    build_tokenizer,
    cache_with_default_target,
    check_thinking_split,
    cli,
    one_line_error,
    processes,
    specbench,
)

pytestmark = pytest.mark.vllm
EAGER = ["--engine-args", '{"enforce_eager": true}']  # compiling would only lengthen the engines' start


@pytest.fixture(autouse=True)
def model_in_the_engine_core(monkeypatch):
    """On a CPU, vLLM runs the model in a worker process beside its engine core's (the multiprocessing
    executor, vllm/platforms/cpu.py); VLLM_ENABLE_V1_MULTIPROCESSING=0 leaves it the uniprocess
    executor, the model in the engine core's process: one process fewer per engine to start, import
    vLLM and torch in, and poll. The same scheduler, model runner and rejection sampler. On 2 cores
    these tests took 9 min 26 s, and 6 min 18 s with it. The runs in this process read it, and every
    process a test starts (vLLM servers, specbench runs) inherits it. specbench leaves vLLM's default
    alone: a benchmark runs vLLM as deployed."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory) -> tuple[str, str]:
    """A 2-layer target and a 1-layer draft with one tokenizer; heads of 32, the least vLLM's CPU
    attention takes."""
    root = tmp_path_factory.mktemp("vllm-pair")
    tokenizer = build_tokenizer(root / "tok")
    return (
        str(build_llama(root / "target", tokenizer, layers=2, hidden=128, seed=0)),
        str(build_llama(root / "draft", tokenizer, layers=1, hidden=128, seed=1)),
    )


def test_vllms_draft_with_its_own_tokenizer_is_the_intersection_beside_specbenchs(vllm_pair, prompts_file, tmp_path):
    """A draft with a tokenizer of its own: --method speculative-intersection under --engine vllm runs
    vLLM's draft model with use_heterogeneous_vocab (its token-level intersection), greedy equal to
    vLLM's baseline and to specbench's loop doing the same."""
    root = tmp_path / "own"
    tokenizer = build_tokenizer(root / "tok", vocab_size=290)  # the target's 320 cut short: its own vocabulary
    draft = str(build_llama(root / "draft", tokenizer, layers=1, hidden=128, seed=1))
    out = tmp_path / "run"
    args = ["--target", vllm_pair[0], "--draft", draft, "--dataset", prompts_file, "--num-prompts", "2"]
    args += ["--max-new-tokens", "12", "--k", "2", "--engine", "torch,vllm", "--method", "speculative-intersection"]
    result = cli("run", *args, *EAGER, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = pd.read_csv(out / "records.csv")
    assert records["outputs_match"].all()
    served = records[(records["engine"] == "vllm") & (records["method"] == "draft")]
    assert len(served) == 2 and (served["drafted"] > 0).all()
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    answers = {}
    for o in outputs:
        answers.setdefault(o["prompt_index"], set()).add(tuple(o["token_ids"]))
    assert all(len(tokens) == 1 for tokens in answers.values())  # every engine and method, one answer per prompt


def test_engines_side_by_side_on_the_same_prompts(vllm_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    args = ["--target", vllm_pair[0], "--draft", vllm_pair[1], "--dataset", prompts_file, "--num-prompts", "3"]
    args += ["--max-new-tokens", "12", "--k", "2", "--engine", "torch,vllm", "--method", "speculative,prompt-lookup"]
    result = cli("run", *args, *EAGER, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = pd.read_csv(out / "records.csv")
    served = records[records["engine"] == "vllm"]
    assert sorted(set(zip(served["method"], served["k"].fillna(0), strict=True))) == [
        ("baseline", 0),
        ("draft", 2),
        ("ngram", 2),
    ]
    assert len(served) == 9 and (served["concurrency"] == 1).all()
    assert served["outputs_match"].all()  # greedy: every vLLM method equals vLLM's baseline per prompt
    drafting = served[served["method"] != "baseline"]
    assert (drafting["drafted"] > 0).all() and (drafting["accepted"] <= drafting["drafted"]).all()
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    by_prompt = {}
    for o in outputs:
        if o["engine"] == "vllm":
            by_prompt.setdefault(o["prompt_index"], set()).add(tuple(o["token_ids"]))
    assert all(len(tokens) == 1 for tokens in by_prompt.values()) and len(by_prompt) == 3
    summary = pd.read_csv(out / "summary.csv")
    draft = summary[(summary["engine"] == "vllm") & (summary["method"] == "draft")].iloc[0]
    assert 0 < draft["c"] and draft["vs_specbench"] > 0 and 0 <= draft["alpha_estimate"] <= 1
    assert set(pd.read_csv(out / "engine_costs.csv")["model"]) == {"target", "draft"}
    acceptance = pd.read_csv(out / "acceptance.csv")
    assert set(acceptance["engine"]) == {"torch", "vllm"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["resolved"]["vllm"] and meta["config"]["engine_args"] == {"enforce_eager": True}

    # An interruption after vLLM's draft rows: --resume keeps them and runs only what is missing.
    kept = records[~((records["engine"] == "vllm") & (records["method"] == "ngram"))]
    kept.to_csv(out / "records.csv", index=False)
    resumed = cli("run", *args, *EAGER, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = pd.read_csv(out / "records.csv")
    assert len(again) == len(records)
    assert (
        again[again["method"] == "draft"]["method_s"].tolist()
        == records[records["method"] == "draft"]["method_s"].tolist()
    )


@pytest.fixture(scope="module")
def sharded_pair(tmp_path_factory) -> tuple[str, str]:
    """A 2-layer target whose 4 attention heads and 2 key/value heads split over two workers, with
    untied embeddings so that its greedy answers vary (vllm_pair's repeat one token), and a draft
    made of its first layer under a noisy head: it agrees with 39 of the target's 64 greedy tokens
    on the requests below (float32, transformers), so drafts are both accepted and rejected."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    root = tmp_path_factory.mktemp("sharded-pair")
    tokenizer = build_tokenizer(root / "tok")
    target = build_llama(root / "target", tokenizer, layers=2, hidden=128, seed=1, tie=False)
    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    draft = LlamaForCausalLM(type(full.config)(**{**full.config.to_dict(), "num_hidden_layers": 1}))
    draft.load_state_dict(full.state_dict(), strict=False)  # the second layer's weights have no place
    torch.manual_seed(2)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(0.3 * head.std() * torch.randn_like(head))
    draft.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    return str(target), str(root / "draft")


def test_tensor_parallel_2_speculates_as_1_and_vllms_counters_equal_its_histograms(sharded_pair, tmp_path):
    """The same draft-model engine at tensor parallel size 1, then 2 (two worker processes, which
    specbench binds to cores of their own where vLLM's own binding, a NUMA node per worker, cannot):
    greedy, every request's tokens are equal, and in each engine vLLM's counters are the sum of its
    per-request histograms. One test for both, as each engine takes 15 s (TP = 1) to 40 s to start."""
    import os

    from specbench.decoding.sampling import Sampling
    from specbench.engines.vllm import BIND, Engine, EngineSpec, numa_nodes

    target, draft = sharded_pair
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    requests = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    answers = {}
    for tp in (1, 2):
        engine_spec = EngineSpec(target, "float32", 0, 64, 2, spec, parallel={"tensor_parallel_size": tp},
                                 extra={"enforce_eager": True})  # fmt: skip
        with Engine(engine_spec, log=tmp_path / f"tp{tp}" / "vllm.log") as engine:
            before = engine.counters()
            served = sorted(engine.run(requests, 2, Sampling(max_new_tokens=16)), key=lambda s: s.index)
            after = engine.counters()
        answers[tp] = [s.tokens for s in served]
        assert [s.index for s in served] == [0, 1, 2, 3] and all(len(s.tokens) == 16 for s in served)
        # vLLM's per-step counts arrived: no more steps rejected a draft than accepted fewer than K.
        assert all(s.rejected is not None and s.rejected <= sum(s.histogram[:-1]) for s in served)
        hist = [sum(column) for column in zip(*(s.histogram for s in served), strict=True)]
        assert sum(hist[1:]) > 0 and sum(hist[:-1]) > 0  # drafts both accepted and rejected
        delta = {
            name: after.get(name, 0) - before.get(name, 0) for name in after if name != "num_accepted_tokens_per_pos"
        }
        assert delta["num_drafts"] == sum(hist)
        assert delta["num_draft_tokens"] == sum(s.drafted for s in served)
        assert delta["num_accepted_tokens"] == sum(n * count for n, count in enumerate(hist))
        per_position = [
            a - b
            for a, b in zip(
                after["num_accepted_tokens_per_pos"], before.get("num_accepted_tokens_per_pos", [0] * 3), strict=True
            )
        ]
        assert per_position == [sum(hist[i + 1 :]) for i in range(3)]  # position i accepted when more than i were
    assert answers[2] == answers[1]
    assert len(set(answers[1][0])) > 4  # greedy answers that vary: no token repeated throughout
    log = (tmp_path / "tp2" / "vllm.log").read_text()
    assert "world_size=2" in log  # vLLM's own output, its workers' included, is in the log
    if numa_nodes() < 2:
        assert "VLLM_CPU_OMP_THREADS_BIND='0|1'" in log  # specbench's binding reached vLLM
    assert BIND not in os.environ  # set for that engine's start alone


def test_a_vllm_engine_that_cannot_start_is_one_line_naming_its_log(sharded_pair, tmp_path, monkeypatch, capfd):
    """A binding that vLLM refuses (one core list for two workers) fails in vLLM's engine core
    process: one line says what vLLM raised and names the log in the run folder, which holds its
    traceback; nothing of vLLM's reaches the terminal."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    out = tmp_path / "run"
    args = ["--target", sharded_pair[0], "--num-prompts", "1", "--max-new-tokens", "4", "--engine", "vllm"]
    args += ["--method", "ngram", "--k", "2", "--tensor-parallel-size", "2", *EAGER, "--out", str(out)]
    result = cli("run", *args)
    assert result.returncode == 2, result.stderr[-3000:]
    one_line_error(
        result, "vLLM could not start the engine for", "doesn't match local world size 2", str(out / "vllm.log")
    )
    shown = capfd.readouterr()
    assert "Traceback" not in shown.out + shown.err and "EngineCore" not in shown.out + shown.err
    log = (out / "vllm.log").read_text()
    assert "Traceback" in log and "AssertionError: Given number of CPU id list ['0']" in log


def test_random_weights_time_the_architecture_in_vllm(tmp_path):
    out = tmp_path / "run"
    args = ["--target", "llama-68m", "--random-weights", "--prompt-tokens", "16", "--num-prompts", "2"]
    args += ["--max-new-tokens", "8", "--engine", "vllm", "--method", "ngram", "--k", "2", "--concurrency", "1,2"]
    result = cli("run", *args, *EAGER, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(zip(summary["method"], summary["concurrency"], strict=True)) == [
        ("baseline", 1),
        ("baseline", 2),
        ("ngram", 1),
        ("ngram", 2),
    ]
    assert summary["alpha_estimate"].isna().all()  # random weights: acceptance means nothing
    assert (summary["throughput"] > 0).all() and (out / "concurrency.png").is_file()
    assert json.loads((out / "meta.json").read_text())["resolved"]["weights"] == "random"


def test_one_eagle3_head_drafts_in_both_engines(tmp_path):
    # A head in the published EAGLE-3 format, built here, for a 4-layer target (three distinct layers
    # to read): specbench's eagle and vLLM's eagle3 load the same directory in one run.
    from transformers import AutoConfig

    from tests.helpers import build_eagle3_head

    tokenizer = build_tokenizer(tmp_path / "tok")
    target = build_llama(tmp_path / "target", tokenizer, layers=4, hidden=128, seed=0)
    head = build_eagle3_head(tmp_path / "head", AutoConfig.from_pretrained(target), taps=(1, 2, 3), seed=1, scale=1.0)
    out = tmp_path / "run"
    args = ["--target", str(target), "--method", "eagle", "--speculator", str(head), "--k", "2", "--num-prompts", "2"]
    result = cli("run", *args, "--max-new-tokens", "12", "--engine", "torch,vllm", *EAGER, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = pd.read_csv(out / "summary.csv")
    rows = set(zip(summary["engine"], summary["method"], strict=True))
    assert {("torch", "eagle"), ("vllm", "eagle3")} <= rows
    assert (summary["outputs_match"] == 2).all()  # greedy: each engine's rows equal its own baseline


def test_vllms_per_step_counts_split_thinking_from_answering(tmp_path):
    """vLLM says how each verify step drafted and accepted (its detailed per-request metrics): on a
    pair that thinks (helpers.build_thinking_pair), each answer's spans add up to its totals, and its
    labels are its own tokens'."""
    target, draft, prompts = build_thinking_pair(tmp_path / "pair")
    out = tmp_path / "run"
    args = ["--target", target, "--draft", draft, "--dataset", prompts, "--engine", "vllm", "--method", "draft"]
    result = cli("run", *args, "--k", "2", "--max-new-tokens", "32", *EAGER, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "thinking apart from answering" in result.stdout
    records = check_thinking_split(out, {("vllm", "draft")})
    drafting = records[records["method"] == "draft"]
    assert (drafting["answer_tokens"] > 0).any() and drafting["thinking_accepted"].sum() > 0
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert summary.loc["draft", "thinking_acceptance"] == pytest.approx(
        drafting["thinking_accepted"].sum() / drafting["thinking_drafted"].sum()
    )


def test_conversations_go_turn_by_turn_through_vllm(vllm_pair, tmp_path):
    """Two-turn questions at two requests in flight: each engine renders a second turn from its own
    first answers (in waves), and the rows carry their turn and category."""
    from transformers import AutoTokenizer

    from specbench.models.pair import encode_turn
    from specbench.workloads.prompts import load_prompts

    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": 81 + i, "category": c, "turns": [f"def f{i}(a):", "for k in range(3):"]} for i, c in
            enumerate(["writing", "coding", "writing"])]  # fmt: skip
    rows.append({"question_id": 161, "category": "translation", "turns": ["print('hola')"]})
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    args = ["--target", vllm_pair[0], "--draft", vllm_pair[1], "--dataset", str(questions), "--max-new-tokens", "10"]
    args += ["--k", "2", "--engine", "vllm", "--method", "draft", "--concurrency", "2"]
    result = cli("run", *args, *EAGER, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = pd.read_csv(out / "records.csv")
    assert len(records) == 2 * 7 and sorted(set(records["turn"])) == [1, 2]
    assert records["outputs_match"].all()  # greedy: the draft's every turn equals vLLM's baseline's
    tokenizer = AutoTokenizer.from_pretrained(vllm_pair[0])
    prompts = load_prompts(str(questions))
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    answer = {(o["method"], o["prompt_index"]): o["token_ids"] for o in outputs}
    for row in records[records["turn"] == 2].to_dict("records"):
        first = tokenizer.decode(answer[(row["method"], row["prompt_index"] - 1)], skip_special_tokens=True).strip()
        conversation = prompts[row["prompt_index"] // 2]
        assert row["prompt_tokens"] == len(encode_turn(tokenizer, conversation, [first], chat=False))
    categories = pd.read_csv(out / "categories.csv")
    assert set(categories["category"]) == {"writing", "coding", "translation"}
    assert (categories["engine"] == "vllm").all() and (categories["concurrency"] == 2).all()


def kill_server_on(port: int) -> None:
    """SIGKILL to the process group of the vLLM server started with ``--port port``."""
    import os
    import signal

    for pid, _, argv, _ in processes():
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            os.killpg(pid, signal.SIGKILL)
            return
    raise AssertionError(f"no vLLM server on port {port}")


def vllm_server(model: str, *extra: str) -> str:
    """The command of a vLLM OpenAI server on CPU for --launch (``{port}`` left for it to fill)."""
    import shlex
    import sys

    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", "{port}"]
    args += ["--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--seed", "0", "--max-model-len", "256"]
    args += ["--no-enable-prefix-caching", *extra]
    return shlex.join(args).replace("'{port}'", "{port}")


def speculating(draft: str | None, k: int, method: str = "draft_model") -> tuple[str, ...]:
    config = {"method": method, "num_speculative_tokens": k} | ({"model": draft} if draft else {})
    if method == "ngram":
        config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return ("--speculative-config", json.dumps(config), "--per-request-spec-decode-metrics", "detailed")


def test_vllm_servers_side_by_side_and_a_killed_baseline_resumes(vllm_pair, tmp_path, monkeypatch):
    """Real vLLM OpenAI servers on loopback: a baseline the test starts itself, and a draft-model and
    an ngram server specbench launches; rows per server, concurrency and category, acceptance equal
    to the servers' own counters, greedy outputs equal. Then the baseline is killed mid-run: the
    finished rows stay, and --resume against it restarted finishes the run."""
    import signal
    import subprocess
    import sys
    import time

    from specbench.engines.launch import free_port, launched

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    target, draft = vllm_pair
    questions = tmp_path / "question.jsonl"
    rows = [{"question_id": 81 + i, "category": c, "turns": [f"def f{i}(a):", "for k in range(3):"]}
            for i, c in enumerate(["writing", "coding"])]  # fmt: skip
    rows += [{"question_id": 161 + i, "category": "translation", "turns": [f"print('hola {i}')"]} for i in range(2)]
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    common = ["run", "--engine", "server", "--target", target, "--baseline-url", base_url, "--warmup", "1"]
    out = tmp_path / "run"
    with launched("baseline", vllm_server(target), tmp_path / "logs", port=port):
        launch = ["--launch", f"draft2={vllm_server(target, *speculating(draft, 2))}"]
        launch += ["--launch", f"ngram={vllm_server(target, *speculating(None, 2, 'ngram'))}"]
        first = [*common, "--dataset", str(questions), *launch, "--max-new-tokens", "16", "--concurrency", "1,2"]
        result = specbench(*first, "--out", str(out), timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        records = pd.read_csv(out / "records.csv", keep_default_na=False)
        summary = pd.read_csv(out / "summary.csv")
        counters = pd.read_csv(out / "counters.csv")
        assert len(records) == 3 * 2 * 6 and (records["error"] == "").all()
        assert sorted(set(zip(summary["method"], summary["concurrency"], strict=True))) == [
            (m, n) for m in ("baseline", "draft2", "ngram") for n in (1, 2)
        ]
        spec = records[records["method"] != "baseline"]
        assert spec["outputs_match"].map(str).eq("True").all()  # greedy: equal to the baseline server's
        assert (spec["acceptance_source"] == "response").all() and set(spec["k"].astype(int)) == {2}
        for (method, n), block in spec.groupby(["method", "concurrency"]):
            grew = counters[(counters["method"] == method) & (counters["concurrency"] == n)].iloc[0]
            assert block["accepted"].astype(int).sum() == grew["num_accepted_tokens"]
            assert block["drafted"].astype(int).sum() == grew["num_draft_tokens"]
        categories = pd.read_csv(out / "categories.csv")
        assert {"writing", "coding", "translation"} <= set(categories["category"])
        assert (tmp_path / "run" / "servers" / "draft2.log").is_file()

        # A baseline killed mid-run: the rows so far stay; --resume finishes against it restarted.
        # The run is paused (SIGSTOP) once two baseline rows are written, so that the kill lands
        # with six of its eight requests still to send. Answers of 200 tokens (the servers hold 256)
        # keep those six busy for seconds: with 32, a CI run in which this test's poll was starved
        # by the other worker's engines saw all eight answered before the pause, and no error.
        singles = tmp_path / "singles.jsonl"
        singles.write_text("".join(
            json.dumps({"question_id": 1 + i, "category": "coding", "turns": [f"def g{i}(x):"]}) + "\n" for i in range(8)
        ))  # fmt: skip
        out = tmp_path / "killed"
        args = [*common, "--dataset", str(singles), "--server", "none=http://127.0.0.1:9/v1"]
        args += ["--max-new-tokens", "200", "--out", str(out)]
        running = subprocess.Popen(
            [sys.executable, "-m", "specbench", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
            (out / "records.csv").is_file() and len((out / "records.csv").read_text().splitlines()) >= 3
        ):
            time.sleep(0.02)
        running.send_signal(signal.SIGSTOP)
        kill_server_on(port)  # SIGKILL: on SIGTERM vLLM would first finish the request in flight
        running.send_signal(signal.SIGCONT)
    _, stderr = running.communicate(timeout=300)
    assert running.returncode != 0 and "--resume" in " ".join(stderr.split()), stderr[-2000:]
    kept = pd.read_csv(out / "records.csv", keep_default_na=False)
    assert (kept["error"] == "").sum() >= 2
    with launched("baseline", vllm_server(target), tmp_path / "logs2", port=port):
        result = specbench(*args, "--resume", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = pd.read_csv(out / "records.csv", keep_default_na=False)
    base, none = records[records["method"] == "baseline"], records[records["method"] == "none"]
    # Every prompt once, none failed.
    assert len(base) == len(none) == 8 and (base["error"] == "").all() and (none["error"] != "").all()
    assert base["prompt_index"].is_unique


def test_the_audit_of_vllm_passes_greedy_and_records_what_it_refuses(tmp_path):
    """specbench audit of vLLM's draft-model and n-gram speculation against vLLM without it: greedy
    answers equal (or near-ties), logprobs equal, and greedy answers that end where a stop string
    appears; min-p, which vLLM refuses with speculation, is recorded as no answer with vLLM's reason
    (not a crash, not a pass), so the exit code is 3."""
    # The audit's pair (a target of moderate entropy), 128 wide for vLLM's CPU attention.
    target, draft, prompts = audit_workload(tmp_path / "pair", hidden=128)
    args = ["--target", target, "--draft", draft, "--dataset", prompts, "--num-prompts", "4"]
    args += ["--engine", "vllm", "--method", "draft,ngram", "--k", "2", "--prompts", "1", "--greedy-tokens", "48"]
    args += ["--setting", "greedy", "--setting", "temperature=1,min_p=0.05", "--samples", "200", "--power-tv", "0.5"]
    result = cli("audit", *args, *EAGER, "--out", str(tmp_path / "audit"))
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 3, result.stderr[-3000:]
    report = json.loads((tmp_path / "audit" / "audit.json").read_text())
    for subject in ("vllm draft K=2", "vllm ngram K=2"):
        rows = {(r["test"], r["setting"]): r for r in report["rows"] if r["subject"] == subject}
        assert rows[("greedy", "greedy")]["verdict"] == "pass"
        assert rows[("logprobs", "greedy")]["verdict"] == "pass"
        assert rows[("stop-string", "")]["verdict"] == "pass", rows[("stop-string", "")]
        refused = rows[("sampling", "temperature=1,min_p=0.05")]
        assert refused["verdict"] == "no answer" and "min_p" in refused["evidence"]
    assert report["groups"][0]["stop_string"]  # the probe ran, with the pilot's most frequent token


def test_vllm_writes_distills_answers_from_the_targets_weights(tmp_path, monkeypatch):
    """--teacher-engine vllm on the default target: the torch target reads its first shard again and
    agrees (teacher.json), greedy answers are the recorded likeliest tokens, and a draft trains on them."""
    import torch
    from typer.testing import CliRunner

    from specbench.cli.app import app
    from specbench.engines.vllm import EngineSpec
    from specbench.training.teacher import MAX_LOGP_DIFFERENCE, MIN_AGREEMENT

    monkeypatch.setenv("SPECBENCH_CACHE", str(cache_with_default_target(tmp_path / "cache")))
    # In this process, so that the teacher's engine can be made eager like every other engine here:
    # compiling the real target took minutes of the test and wrote vLLM's cache outside tmp_path.
    kwargs = EngineSpec.kwargs
    monkeypatch.setattr(EngineSpec, "kwargs", lambda spec: {**kwargs(spec), "enforce_eager": True})
    out = tmp_path / "draft"
    args = ["--teacher-engine", "vllm", "--teacher-tokens", "0", "--data", "humaneval", "--generate-prompts", "8"]
    args += ["--generate-batch", "4", "--generate-new-tokens", "24", "--top-k", "8", "--sampled-fraction", "0.5"]
    args += ["--epochs", "1", "--batch", "4", "--seq-len", "64", "--out", str(out)]
    result = CliRunner().invoke(app, ["distill", *args])
    assert result.exit_code == 0, (result.output[-3000:], result.exception)
    found = json.loads((out / "generated" / "teacher.json").read_text())
    assert found["engine"] == "vllm" and found["top1_agreement"] >= MIN_AGREEMENT, found
    assert found["mean_abs_logp_difference"] <= MAX_LOGP_DIFFERENCE, found
    shards = sorted((out / "generated").glob("*.pt"))
    assert len(shards) == 2
    for b, path in enumerate(shards):
        docs = torch.load(path)
        assert len(docs) == 4
        for doc in docs:
            answer = doc["ids"][doc["prompt_len"] :]
            assert 0 < len(answer) <= 24 and doc["top_idx"].shape == (len(answer), 8)
            assert (doc["top_logp"][:, :-1] >= doc["top_logp"][:, 1:]).all()  # likeliest first
            if b == 0:  # the greedy shard (sampled-fraction 0.5: the second is sampled)
                assert torch.equal(answer, doc["top_idx"][:, 0].to(answer.dtype))
    assert (out / "config.json").is_file()  # the draft trained on them
