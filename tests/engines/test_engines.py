"""Engines other than specbench's loop (vLLM), without starting one: the mapping of vLLM's counters to
specbench's columns, the rows and summary built from requests, and every bad input refused before
an engine starts. The tests that start engines are in test_vllm.py."""

import math
import random
import sys
from dataclasses import replace

import pytest

from specbench.bench.config import BenchConfig
from specbench.bench.run import run_columns
from specbench.cli.app import main
from specbench.core import metrics
from specbench.core.errors import SpecbenchError
from specbench.core.thinking import Markers
from specbench.engines import Served
from specbench.engines.vllm import EngineLog, EngineSpec, cpu_binding, cpu_split, error_line
from specbench.methods.base import Decoder
from specbench.methods.served import SERVED, SERVED_BASELINE
from specbench.results import schema, serving
from specbench.results.report import phase_table
from specbench.workloads.prompts import Prompt, Turn


def test_counts_map_a_hand_built_histogram_to_the_columns():
    # K=3: 2 steps accepted none, 1 accepted one, 3 accepted all three; 18 drafts proposed.
    hist = [2, 1, 0, 3]
    found = serving.counts(_served(hist, drafted=18, tokens=20))
    assert found == {"drafted": 18, "accepted": 10, "tested": 13, "target_forwards": 10, "accept_hist": "2 1 0 3"}
    # Without vLLM's per-step counts every step short of K is a rejection: alpha~ = 10 / (10 + 3).
    # With them, a step that drafted fewer than K tokens and kept them all is none.
    assert serving.counts(_served(hist, drafted=16, tokens=20, rejected=2))["tested"] == 12
    # position i accepted in the steps that accepted more than i: 4, 3, 3 of 6
    assert metrics.acceptance_by_position(hist) == pytest.approx([4 / 6, 3 / 6, 3 / 6])
    assert serving.counts(_served(None, 0, 7))["target_forwards"] == 7  # no speculation: a forward per token


def test_forwards_of_a_request_cut_at_the_token_limit():
    # Seen on vLLM (draft model, K=4, 64 tokens at most): 50 verify steps accepted 16 drafts, 3 of
    # them past the cut. The tokens less the accepted (48) miss 3 forwards; the steps and the prefill
    # (51) count them.
    hist = [40, 6, 3, 0, 1]
    assert (sum(hist), sum(n * c for n, c in enumerate(hist))) == (50, 16)
    assert serving.counts(_served(hist, drafted=200, tokens=64))["target_forwards"] == 51
    # n-grams draft only where they find a match: 5 steps drafted and 20 forwards did not.
    assert serving.counts(_served([3, 0, 2], drafted=10, tokens=30))["target_forwards"] == 26


def _served(histogram, drafted, tokens, rejected=None):
    return Served(0, list(range(tokens)), 0.0, 0.0, 1.0, histogram, drafted, rejected)


def test_alpha_estimate_recovers_the_alpha_of_independent_acceptances():
    rng = random.Random(0)
    for alpha, k in ((0.3, 2), (0.7, 4), (0.9, 6)):
        hist = [0] * (k + 1)
        for _ in range(20000):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            hist[accepted] += 1
        found = serving.counts(_served(hist, k * sum(hist), 0))
        assert found["accepted"] / found["tested"] == pytest.approx(alpha, abs=0.01)


def _cfg(**given):
    return BenchConfig(**{"engines": ["vllm"], "methods": ["draft"], "ks": [2], "num_prompts": 2, **given})


def test_records_and_summary_of_requests_in_flight():
    cfg = _cfg(concurrency=[2])
    prompts = [Turn(Prompt(name, (name,)), i, 1) for i, name in enumerate("ab")]
    base = [Served(0, [5, 6, 7, 8], 0.0, 0.1, 0.4, None), Served(1, [5, 6], 0.0, 0.1, 0.2, None)]
    # The draft's request 1 diverges at token 1; both ran at once from t=0.
    draft = [Served(0, [5, 6, 7, 8], 0.0, 0.05, 0.2, [1, 0, 1], 4), Served(1, [5, 9], 0.0, 0.05, 0.15, [1, 0, 0], 2)]
    decoder = Decoder(SERVED["draft"], 2)
    load = (2, math.inf)
    rows = [serving.record(prompts[i], i, [1], Decoder(SERVED_BASELINE), load, base[i], base[i]) for i in range(2)]
    rows += [serving.record(prompts[i], i, [1], decoder, load, draft[i], base[i]) for i in range(2)]
    assert set(rows[0]) == set(schema.RECORDS)
    first = rows[2]
    assert first["speedup"] == pytest.approx((4 / 0.2) / (4 / 0.4))
    assert first["ttft_ms"] == pytest.approx(50) and first["tpot_ms"] == pytest.approx(1000 * 0.15 / 3)
    # two verify steps and the prefill: 3 forwards for 4 tokens (the second decoder was cut at the limit)
    assert (first["accepted"], first["target_forwards"], first["tau"]) == (2, 3, 4 / 3)
    assert (rows[3]["outputs_match"], rows[3]["first_divergence"]) == (False, 1)
    costs = [serving.decode_cost([10.0], "vllm", "target"), serving.decode_cost([2.0], "vllm", "draft")]
    columns = run_columns(cfg, {"target": "t", "draft": "d", "dataset": "x"})
    summary = serving.summarize(rows, costs, [], [cfg.served_baseline, *cfg.served_plan], cfg.loads, columns)
    assert [(r["method"], r["concurrency"]) for r in summary] == [("baseline", 2), ("draft", 2)]
    row = summary[1]
    assert row["throughput"] == pytest.approx(6 / 0.2) and row["throughput_speedup"] == pytest.approx(30 / (6 / 0.4))
    assert row["c"] == pytest.approx(0.2) and row["outputs_match"] == 1 and row["first_divergence"] == 1
    assert row["alpha_estimate"] == pytest.approx(2 / (2 + 2))  # hist 2 0 1: two accepted, two stops short
    assert row["predicted_speedup"] == pytest.approx(metrics.predicted_speedup(0.5, 0.2, 2))
    assert math.isnan(row["vs_specbench"])  # no --engine torch: no specbench baseline to compare with


def test_a_served_row_per_method_and_k_when_the_plan_has_a_decoder_per_k():
    cfg = _cfg(ks=[2, 3])
    assert [d.k for d in cfg.served_plan] == [2, 3]  # an engine per K
    turn = Turn(Prompt("a", ("a",)), 0, 1)
    base = Served(0, [5, 6, 7], 0.0, 0.1, 0.3, None)
    load = (1, math.inf)
    rows = [serving.record(turn, 0, [1], Decoder(SERVED_BASELINE), load, base, base)]
    for decoder in cfg.served_plan:
        rows.append(serving.record(turn, 0, [1], decoder, load, Served(0, [5, 6, 7], 0.0, 0.1, 0.2, [1, 1], 2), base))
    costs = [serving.decode_cost([10.0], "vllm", "target"), serving.decode_cost([2.0], "vllm", "draft")]
    columns = run_columns(cfg, {"target": "t", "draft": "d", "dataset": "x"})
    summary = serving.summarize(rows, costs, [], [cfg.served_baseline, *cfg.served_plan], cfg.loads, columns)
    assert [(r["method"], r["k"]) for r in summary] == [("baseline", None), ("draft", 2), ("draft", 3)]


def test_a_served_answer_is_split_by_its_steps_and_the_arrival_of_its_ids():
    """A served request's thinking split: vLLM's per-step counts after the prefill's token, and each
    id's arrival from its chunk; steps that do not fit the tokens (vLLM leaves out those that did not
    draft) leave the counts empty, and text without ids the seconds."""
    cfg = _cfg()
    markers = Markers(5, 6)
    turn, load = Turn(Prompt("a", ("a",)), 0, 1), (1, math.inf)
    # The prompt ends in <think>: tokens 0-2 think (2 is the close), 3-4 answer.
    tokens = [1, 2, 6, 3, 4]
    base = Served(0, tokens, 1.0, 1.1, 1.5, None, arrivals=[1.1, 1.2, 1.3, 1.4, 1.5])
    # Steps after the prefill: one kept 2 of 2 (tokens 1-3), one kept 0 of 2 (token 4).
    draft = Served(0, tokens, 1.0, 1.1, 1.3, [1, 0, 1], 4, steps=[(2, 2), (2, 0)], arrivals=[1.1, 1.2, 1.2, 1.2, 1.3])
    decoder = cfg.served_plan[0]
    base_row = serving.record(turn, 0, [9, 5], Decoder(SERVED_BASELINE), load, base, base, markers=markers)
    row = serving.record(turn, 0, [9, 5], decoder, load, draft, base, markers=markers)
    assert (row["thinking_tokens"], row["answer_tokens"]) == (3, 2)
    assert (row["thinking_forwards"], row["thinking_drafted"], row["thinking_accepted"]) == (2, 2, 2)
    assert (row["answer_forwards"], row["answer_drafted"], row["answer_accepted"]) == (1, 2, 0)
    assert (row["thinking_s"], row["answer_s"]) == (pytest.approx(0.2), pytest.approx(0.1))
    assert row["thinking_speedup"] == pytest.approx((3 / 0.2) / (3 / 0.3))
    assert (base_row["thinking_forwards"], base_row["answer_forwards"]) == (3, 2)  # the baseline: a token a forward
    # vLLM left out a step that drafted nothing: the counts cannot be placed.
    short = serving.record(turn, 0, [9, 5], decoder, load, replace(draft, steps=[(2, 2)]), base, markers=markers)
    assert short["thinking_tokens"] == 3 and math.isnan(short["thinking_accepted"]) and short["thinking_s"] > 0
    text = serving.record(turn, 0, [9, 5], decoder, load, replace(draft, encoded=True), base, markers=markers)
    assert math.isnan(text["thinking_s"]) and text["thinking_accepted"] == 2


def test_acceptance_from_counters_is_the_blocks_own_k():
    # A server per K (llama-cpp, vLLM): each block's counters are its K's, not the last K's.
    load = (1, math.inf)
    grew = [
        serving.counter_row("llama-cpp", "ngram-simple", k, load, {}, {"num_drafts": n, "num_draft_tokens": 2 * n,
                            "num_accepted_tokens": a})
        for k, n, a in ((2, 10.0, 5.0), (4, 20.0, 30.0))
    ]  # fmt: skip
    rs = [{"error": "", "new_tokens": 8, "acceptance_source": ""}]
    assert serving.acceptance(rs, grew, "llama-cpp", "ngram-simple", 2, load)["accepted"] == 5.0
    assert serving.acceptance(rs, grew, "llama-cpp", "ngram-simple", 4, load)["accepted"] == 30.0
    assert serving.acceptance(rs, grew, "llama-cpp", "ngram-simple", 3, load)["acceptance_source"] == ""


def test_engine_spec_passes_the_distributed_settings_through():
    spec = EngineSpec("m", "float32", 0, 128, 4, {"method": "ngram"}, True, {"tensor_parallel_size": 2}, {"x": 1})
    kwargs = spec.kwargs()
    assert kwargs["load_format"] == "dummy" and kwargs["tensor_parallel_size"] == 2 and kwargs["x"] == 1
    assert kwargs["skip_tokenizer_init"] and kwargs["per_request_spec_decode_metrics"] == "detailed"
    assert "per_request_spec_decode_metrics" not in EngineSpec("m", "float32", 0, 128, 4).kwargs()


def test_methods_map_to_their_vllm_counterparts():
    cfg = BenchConfig(engines=["torch", "vllm"], methods=["speculative", "prompt-lookup", "tree", "hf-generate"])
    assert [d.label for d in cfg.served_plan] == ["draft K=4", "ngram K=4"]
    assert [d.method.name for d in cfg.plan] == ["speculative", "prompt-lookup", "tree", "hf-generate"]
    assert BenchConfig(engines=["vllm"]).plan == []


@pytest.mark.parametrize(
    "args, says",
    [
        (["--engine", "vllm", "--method", "tree"], "--method tree does not run in vLLM"),
        (["--method", "ngram"], "--method ngram is vLLM's: add --engine vllm (specbench's own is prompt-lookup)"),
        (["--engine", "vllm", "--method", "eagle", "--target", "llama-68m"], "--method eagle needs --speculator PATH"),
        (["--engine", "vllm", "--method", "eagle3", "--speculator", "/nonexistent"], "no such directory"),
        (["--engine", "vllm", "--concurrency", "0"], "--concurrency must be at least 1"),
        (["--concurrency", "4"], "--concurrency above 1 needs --engine vllm or server"),
        (["--engine", "vllm", "--concurrency", "4", "--num-prompts", "2"], "needs as many prompts"),
        (["--engine", "vllm", "--tensor-parallel-size", "512"], "needs 512 devices and this machine has"),
        (["--engine", "gpu"], "--engine gpu: use one of torch, vllm"),
        (
            ["--tensor-parallel-size", "2"],
            "--tensor-parallel-size is read only by --engine vllm, not by --engine torch: add --engine vllm",
        ),
        (["--engine", "vllm", "--engine-args", "{bad"], "--engine-args '{bad' is not valid JSON"),
        (["--engine", "vllm", "--eta", "0.1"], "vLLM has no eta sampling"),
    ],
)
def test_bad_engine_input_is_one_line_and_exit_2_before_anything_starts(args, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["specbench", "run", *args, "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exited:
        main()
    said = capsys.readouterr().err
    assert exited.value.code == 2 and says in " ".join(said.split()), said
    assert len(said.strip().splitlines()) <= 2 and "Traceback" not in said  # one line (wrapped at most once)
    assert not (tmp_path / "run" / "meta.json").exists()  # refused before the run began


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--pipeline-parallel-size", "2", "--method", "prompt-lookup"],
            "--pipeline-parallel-size 2 with speculation (ngram K=4): vLLM's CPU worker cannot draft across "
            "pipeline stages",
        ),
        (["--tensor-parallel-size", "512"], "bind vLLM's workers to cores yourself with VLLM_CPU_OMP_THREADS_BIND"),
    ],
)
def test_what_vllm_cannot_run_on_a_cpu_is_refused_before_it_starts(args, says, tmp_path, monkeypatch, capsys):
    """Pipeline parallelism with speculation fails inside vLLM's CPU worker ('CPUModelRunner' object
    has no attribute 'drafter'); more workers than cores name the setting that binds them."""
    import time

    import specbench.bench.config

    monkeypatch.setattr(specbench.bench.config, "on_cpu", lambda device: True)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(sys, "argv", ["specbench", "run", "--engine", "vllm", *args, "--out", str(tmp_path / "run")])
    began = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        main()
    said = capsys.readouterr().err
    assert exited.value.code == 2 and says in " ".join(said.split()), said
    assert len(said.strip().splitlines()) <= 2 and "Traceback" not in said
    assert not (tmp_path / "run").exists() and time.monotonic() - began < 5


def test_cpu_workers_get_the_usable_cores_split_between_them():
    assert cpu_split({0, 1}, 2) == "0|1"
    assert cpu_split(range(8), 2) == "0-3|4-7"
    assert cpu_split([5, 0, 1, 2, 3], 2) == "0-2|3,5"  # a core the process may not use is left out
    assert cpu_split(range(7), 3) == "0-2|3-4|5-6"  # the first groups take what does not divide
    with pytest.raises(
        SpecbenchError, match="need a core each and this process may use 1: .*VLLM_CPU_OMP_THREADS_BIND"
    ):
        cpu_split([3], 2)
    # specbench binds only where vLLM's own binding, a NUMA node per worker, cannot, and never over the user's.
    assert cpu_binding(2, range(4), numa_nodes=1, given=None) == "0-1|2-3"
    assert cpu_binding(2, range(4), numa_nodes=2, given=None) is None
    assert cpu_binding(2, range(4), numa_nodes=1, given="0|0") is None
    assert cpu_binding(1, range(4), numa_nodes=1, given=None) is None


def test_the_error_line_of_vllms_output_is_the_last_thing_raised():
    log = (
        "(EngineCore pid=7) ERROR 11-28 13:18:48 [core.py:1510] EngineCore failed to start.\n"
        "(EngineCore pid=7) ERROR 11-28 13:18:48 [core.py:1510] Traceback (most recent call last):\n"
        "(EngineCore pid=7) ERROR 11-28 13:18:48 [core.py:1510]     len(allowed_numa_nodes) >= local_world_size\n"
        "(EngineCore pid=7) ERROR 11-28 13:18:48 [core.py:1510] AssertionError: Not enough allowed NUMA nodes to "
        "bind threads of 2 local CPUWorkers.\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    assert error_line(log) == "AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers."
    assert error_line("torch._C._LinAlgError: singular\n  File x\n") == "_LinAlgError: singular"
    assert error_line("INFO all well\n") is None


def test_an_engine_that_dies_mid_run_names_the_root_cause_and_its_log(tmp_path):
    """vLLM's client says only that its engine core died ("See stack trace above"): the line a run
    stops with adds what vLLM's output last says was raised, and where that output is."""
    from specbench.decoding.sampling import Sampling
    from specbench.engines import LoopThread
    from specbench.engines.vllm import Engine

    log = EngineLog(tmp_path / "run" / "vllm.log", EngineSpec("m", "float32", 0, 64, 1))
    log.write("(EngineCore pid=7) ERROR [core.py:1] torch.OutOfMemoryError: could not allocate 2.0 GiB\n")
    engine = Engine.__new__(Engine)
    engine.log, engine.driver, engine.requests, engine.detokenizes = log, LoopThread(), 0, False

    class EngineDeadError(Exception):
        pass

    async def dies(requests, concurrency, sampling, rate, tag, indices, finished):
        finished.put(EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause."))

    engine._drive = dies
    try:
        with pytest.raises(SpecbenchError) as raised:
            list(engine.run([[1, 2]], 1, Sampling(temperature=0.0)))
    finally:
        engine.driver.close()
        log.close()
    said = str(raised.value)
    assert said.startswith("the vLLM engine failed mid-run: EngineDeadError: EngineCore encountered an issue")
    assert "the log last says OutOfMemoryError: could not allocate 2.0 GiB" in said
    assert said.endswith(f"(vLLM's output: {tmp_path / 'run' / 'vllm.log'})")


def test_what_processes_started_while_an_engine_starts_print_goes_to_its_log(tmp_path, capfd):
    """vLLM's engine core and workers inherit descriptors 1 and 2 as they start: those point at the
    log meanwhile, while this process's own output (sys.stdout, sys.stderr) stays where it was."""
    import logging
    import subprocess

    log = EngineLog(tmp_path / "run" / "vllm.log", EngineSpec("m", "float32", 0, 64, 1))
    with log.starting():
        child = "import sys; print('from the engine core'); print('Traceback (most recent', file=sys.stderr)"
        subprocess.run([sys.executable, "-c", child], check=True)
        print("specbench's progress")
        logging.getLogger("vllm.platforms").warning("vLLM in this process")
    log.close()
    shown = capfd.readouterr()
    assert "specbench's progress" in shown.out and "engine core" not in shown.out + shown.err
    assert "Traceback" not in shown.err and "vLLM in this process" not in shown.err
    text = (tmp_path / "run" / "vllm.log").read_text()
    assert text.startswith("==== ") and "vLLM engine: m, no speculation" in text.splitlines()[0]
    assert "from the engine core" in text and "Traceback (most recent" in text and "vLLM in this process" in text
    assert "specbench's progress" not in text


def test_vllm_missing_names_its_install_command(monkeypatch):
    import specbench.bench.config

    monkeypatch.setattr(specbench.bench.config, "available", lambda: False)
    with pytest.raises(SpecbenchError, match="make install-vllm"):
        BenchConfig(engines=["vllm"]).validate()


def test_no_phase_table_for_a_serving_engines_rows_alone():
    # A server's time is not split into phases: an empty table would only be noise.
    assert phase_table([{"engine": "llama-cpp"}, {"engine": "vllm"}]) is None
