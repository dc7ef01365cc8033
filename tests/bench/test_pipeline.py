"""The real pipeline on tiny local transformers models: loading, decoding, files, CLI errors."""

import dataclasses
import json
import math
import time

import pandas as pd
import pytest
import torch

from specbench.core import metrics
from specbench.decoding.decode import autoregressive_decode, heuristic_k, speculative_decode
from specbench.decoding.sampling import Sampling
from specbench.drafters.model import ModelDrafter
from specbench.models import lm as lm_module
from specbench.models.lm import HFCausalLM, ShortlistedHead
from specbench.models.load import load, shared_width
from specbench.results import schema

from ..helpers import cli, cli_on_tiny_pair, one_line_error, specbench

CPU, F32 = torch.device("cpu"), torch.float32
SUMMARY_COLUMNS = (
    "target draft dataset num_prompts k temperature top_k top_p seed device dtype new_tokens "
    "baseline_tokens_per_s spec_tokens_per_s speedup alpha acceptance_rate tau c verify_ratio "
    "predicted_speedup predicted_speedup_verify"
).split()


def wrapped(tiny_pair):
    target, draft = load(tiny_pair[0], CPU, F32), load(tiny_pair[1], CPU, F32)
    width = shared_width(target, draft)
    return target, HFCausalLM(target.model, width), HFCausalLM(draft.model, width)


def test_shared_width_slices_the_padded_draft(tiny_pair, padded_draft):
    target, target_lm, draft_lm = wrapped((tiny_pair[0], padded_draft))
    assert draft_lm.model.get_output_embeddings().weight.shape[0] == target.width + 16
    assert target_lm.width == draft_lm.width == target.width
    prompt = target.tokenizer("def add(a, b):\n", return_tensors="pt").input_ids[0]
    greedy, g = Sampling(0.0), torch.Generator()
    want = autoregressive_decode(target_lm, prompt, 30, greedy, g).tokens
    assert speculative_decode(target_lm, ModelDrafter(draft_lm, greedy, g), prompt, 3, 30, greedy, g).tokens == want
    sampled = speculative_decode(
        target_lm, ModelDrafter(draft_lm, Sampling(1.0), g), prompt, 3, 30, Sampling(1.0), g
    ).tokens
    assert max(sampled) < target.width


@pytest.mark.parametrize("host_reads", [True, False], ids=["filled-rows", "all-rows"])
def test_shortlisted_head_scores_the_shortlist_and_what_it_read(tiny_pair, monkeypatch, host_reads):
    # all-rows: CUDA's route, which scores every row of the buffers rather than read their count.
    monkeypatch.setattr(lm_module, "host_reads_free", lambda device: host_reads)
    target, _, draft_lm = wrapped(tiny_pair)
    shortlist = torch.arange(0, draft_lm.width, 3)
    short = HFCausalLM(draft_lm.model, draft_lm.width, shortlist)
    prompt = target.tokenizer("def greet(name):\n", return_tensors="pt").input_ids[0]
    draft_lm.reset()
    full, got = draft_lm.forward(prompt, last=2), short.forward(prompt, last=2)
    scored = torch.zeros(draft_lm.width, dtype=torch.bool)
    scored[shortlist] = scored[prompt] = True
    torch.testing.assert_close(got[:, scored], full[:, scored])
    assert torch.isinf(got[:, ~scored]).all()
    short.reset()  # what the last sequence read is forgotten
    assert torch.isinf(short.forward(prompt[:1])[0, ~scored & (torch.arange(draft_lm.width) % 3 != 0)]).all()


def test_a_shortlisted_head_reads_ids_on_the_device_and_counts_them_only_when_it_may_run_out(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(lm_module, "SPARE_ROWS", 4)
    monkeypatch.setattr(lm_module, "host_reads_free", lambda device: False)
    reads = []
    filled = ShortlistedHead.filled
    monkeypatch.setattr(ShortlistedHead, "filled", lambda self: reads.append(1) or filled(self))
    weight, hidden = torch.randn(50, 8), torch.randn(2, 8)
    head = ShortlistedHead(weight, torch.tensor([0, 1, 2, 45]), 40)  # 45: past the width, never scored

    def scored_ids() -> set[int]:
        ids, rows = head.scored()
        logits = head.logits(hidden @ rows.T, ids)
        finite = torch.isfinite(logits[0])
        torch.testing.assert_close(logits[:, finite], (hidden @ weight[:40].T)[:, finite])
        assert torch.isinf(logits[:, ~finite]).all()
        return set(torch.nonzero(finite).flatten().tolist())

    head.read(torch.tensor([5, 5, 1]))  # 3 of 7 rows filled, at most 6: no need to count
    assert scored_ids() == {0, 1, 2, 5} and not reads
    head.read(torch.tensor([6, 7]))  # at most 8 of 7: counted (4), and 6 fit
    assert scored_ids() == {0, 1, 2, 5, 6, 7} and len(reads) == 1
    head.read(torch.tensor([8, 9, 10, 11, 8]))  # 6 + 5 > 7: counted again, and the buffers grow, rows kept
    assert scored_ids() == set(range(12)) - {3, 4} and len(reads) == 2 and len(head.ids) > 11
    head.reset()
    assert scored_ids() == {0, 1, 2}


@pytest.mark.parametrize("host_reads", [True, False], ids=["filled-rows", "all-rows"])
def test_greedy_speculative_with_a_shortlisted_draft_equals_the_baseline(tiny_pair, monkeypatch, host_reads):
    monkeypatch.setattr(lm_module, "SPARE_ROWS", 2)  # the buffers grow mid-sequence too
    monkeypatch.setattr(lm_module, "host_reads_free", lambda device: host_reads)
    target, target_lm, draft_lm = wrapped(tiny_pair)
    short = HFCausalLM(draft_lm.model, draft_lm.width, torch.arange(0, draft_lm.width, 2))
    prompt = target.tokenizer("def add(a, b):\n", return_tensors="pt").input_ids[0]
    greedy, g = Sampling(0.0), torch.Generator()
    want = autoregressive_decode(target_lm, prompt, 40, greedy, g).tokens
    assert speculative_decode(target_lm, ModelDrafter(short, greedy, g), prompt, 3, 40, greedy, g).tokens == want


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_speculative_equals_greedy_baseline_on_tiny_transformers_pair(tiny_pair, k):
    target, target_lm, draft_lm = wrapped(tiny_pair)
    prompt = target.tokenizer("def add(a, b):\n", return_tensors="pt").input_ids[0]
    greedy, g = Sampling(0.0), torch.Generator()
    want = autoregressive_decode(target_lm, prompt, 40, greedy, g).tokens
    got = speculative_decode(target_lm, ModelDrafter(draft_lm, greedy, g), prompt, k, 40, greedy, g)
    assert got.tokens == want
    assert got.drafted > 0 and got.target_forwards < 40  # it really speculated


@pytest.mark.parametrize("policy", ["heuristic", "confidence"])
def test_greedy_lookahead_policies_equal_the_greedy_baseline_on_tiny_transformers_pair(
    tiny_pair, untied_target, policy
):
    # The untied target writes varied text: the draft is often rejected, and often unsure where a round starts.
    target, target_lm, draft_lm = wrapped((untied_target, tiny_pair[1]))
    greedy, g = Sampling(0.0), torch.Generator()
    lengths = set()
    for text in ("def add(a, b):\n", "class Stack:\n    def push(self, item):\n", "for k in range(3):\n"):
        prompt = target.tokenizer(text, return_tensors="pt").input_ids[0]
        want = autoregressive_decode(target_lm, prompt, 40, greedy, g).tokens
        drafter = ModelDrafter(draft_lm, greedy, g, p_min=0.97 if policy == "confidence" else None)
        schedule = heuristic_k if policy == "heuristic" else None
        got = speculative_decode(target_lm, drafter, prompt, 3, 40, greedy, g, schedule=schedule)
        assert got.tokens == want
        lengths |= set(got.draft_counts)
    assert len(lengths) > 1  # the lookahead did change from round to round


def test_baseline_matches_transformers_generate(tiny_pair):
    target, target_lm, _ = wrapped(tiny_pair)
    prompt = target.tokenizer("class Point:\n", return_tensors="pt").input_ids
    generated = target.model.generate(prompt, max_new_tokens=25, do_sample=False, eos_token_id=None, pad_token_id=0)
    mine = autoregressive_decode(target_lm, prompt[0], 25, Sampling(0.0), torch.Generator()).tokens
    assert mine == generated[0, prompt.shape[1] :].tolist()


def test_run_writes_every_file_with_the_contract_columns(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    result = cli_on_tiny_pair(
        "run",
        tiny_pair,
        "--k",
        "3",
        "--dataset",
        prompts_file,
        "--max-new-tokens",
        "24",
        "--cost-repeats",
        "3",
        "--threads",
        "1",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv")
    assert set(SUMMARY_COLUMNS) <= set(summary.columns)
    assert summary["method"].tolist() == ["baseline", "speculative"]
    row = summary.iloc[1]
    assert row["k"] == 3 and row["num_prompts"] == 3
    assert row["predicted_speedup"] == pytest.approx(metrics.predicted_speedup(row["alpha"], row["c"], 3), rel=1e-12)
    assert row["predicted_speedup_verify"] == pytest.approx(
        metrics.predicted_speedup_verify(row["alpha"], row["c"], 3, row["verify_ratio"]), rel=1e-12
    )
    assert 0 <= row["alpha"] <= 1 and 1 <= row["tau"] <= 4
    # How close the baseline came to the hardware, measured on this CPU: every row carries the baseline's figure.
    assert (summary["copy_bandwidth_gbs"] > 0).all() and (summary["weight_bytes"] > 0).all()
    assert (summary["baseline_mbu"] > 0).all() and summary["baseline_mbu"].nunique() == 1
    document = json.loads((out / "results.json").read_text())
    assert [r["baseline_mbu"] for r in document["summary"]] == pytest.approx(summary["baseline_mbu"].tolist())
    # The tiny target's steps read a few hundred kB: far below the bandwidth, so the run says what that means.
    assert "baseline MBU" in result.stdout and "launch-bound loop, not of the pair" in " ".join(result.stdout.split())
    records = pd.read_csv(out / "records.csv")
    assert (
        len(records) == 3 * 2 and records["outputs_match"].all()
    )  # the baseline's rows and speculative's; greedy: exact
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(o["method"] for o in outputs) == ["baseline"] * 3 + ["speculative"] * 3
    meta = json.loads((out / "meta.json").read_text())
    assert {"python", "torch", "transformers", "specbench", "device_name", "git_commit", "config"} <= set(meta)
    assert "git_changed_files" in meta
    assert meta["config"]["ks"] == [3] and meta["torch_threads"] == 1  # --threads 1 reached torch


@pytest.mark.slow
def test_sampled_run_is_reproducible(tiny_pair, prompts_file, tmp_path):
    args = [
        "run",
        "--target",
        tiny_pair[0],
        "--draft",
        tiny_pair[1],
        "--k",
        "2",
        "--dataset",
        prompts_file,
        "--max-new-tokens",
        "16",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--cost-repeats",
        "2",
        "--seed",
        "7",
    ]
    first, second = specbench(*args, "--out", str(tmp_path / "a")), specbench(*args, "--out", str(tmp_path / "b"))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert (tmp_path / "a" / "outputs.jsonl").read_text() == (tmp_path / "b" / "outputs.jsonl").read_text()


def test_uncached_hub_model_fails_fast_with_one_line(tmp_path):
    result = specbench(
        "run", "--target", "llama-7b", "--draft", "llama-68m", "--k", "4", "--out", str(tmp_path / "run"), timeout=60
    )
    one_line_error(result, "huggyllama/llama-7b", "not in the local Hugging Face cache", "download", "--random-weights")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--k", "0"], "K must be at least 1"),
        (["--target", "no-such-alias"], "unknown model 'no-such-alias'"),
        (["--dataset", "missing.jsonl"], "dataset file not found"),
        (["--max-new-tokens", "400"], "context window"),
        (["--dataset", "xsum"], "unreachable"),
        (["--threads", "-1"], "--threads must be >= 0"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--temperature", "inf"], "--temperature inf: give a finite number"),
        (["--top-p", "nan"], "--top-p nan: give a finite number"),
        (["--k-policy", "sometimes"], "--k-policy sometimes: use one of fixed, heuristic, confidence"),
        (["--draft-p-min", "0"], "--draft-p-min must be in (0, 1]"),
        (["--draft-p-min", "0.5"], "--draft-p-min is read only by --k-policy confidence, not by --k-policy fixed"),
        (["--k", "1,,2"], "--k '1,,2' has an empty item"),
        (["--method", "speculative,"], "--method 'speculative,' has an empty item"),
        (["--assume-alpha", "0.5,"], "--assume-alpha '0.5,' has an empty item"),
        (
            ["--kv-budget", "64"],
            "--kv-budget is read only by --method self-sparse or triforce, not by --method speculative",
        ),
        (["--method", "speculative,tree", "--lookup-k", "3"], "--lookup-k is read only by --method lookup-or-draft"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_pair, prompts_file, tmp_path, args, needle):
    base = {"--target": tiny_pair[0], "--draft": tiny_pair[1], "--dataset": prompts_file}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    result = cli("run", *[x for kv in base.items() for x in kv], "--out", str(tmp_path / "run"))
    one_line_error(result, needle)
    assert not (tmp_path / "run").exists()  # refused before the run's folder was made


def test_graphs_with_no_compile_is_refused_not_half_heard(tiny_pair, prompts_file, tmp_path):
    # The static path compiles its forwards: --no-compile beside --graphs was silently dropped.
    args = ("--dataset", prompts_file, "--out", tmp_path / "run", "--graphs", "--no-compile")
    result = cli_on_tiny_pair("run", tiny_pair, *args)
    one_line_error(result, "--graphs compiles its forwards", "drop one")


@pytest.mark.parametrize(
    "command, args, needles",
    [
        ("run", ["--dataset-path", "my.jsonl"], ["--dataset-path is read only by --dataset spec-bench", "sharegpt"]),
        ("run", ["--category", "writing"], ["--category is read only by --dataset", "not by --dataset humaneval"]),
        (
            "run",
            ["--dataset", "longcode", "--context-tokens", "64", "--per-category", "2"],
            ["--per-category is read only"],
        ),
        ("run", ["--engine", "vllm", "--repeats", "3"], ["--repeats is read only by --engine torch, not by --engine"]),
        ("run", ["--engine", "vllm", "--no-compile"], ["--no-compile is read only by --engine torch"]),
        ("run", ["--api", "chat"], ["--api is read only by --engine server or llama-cpp", "add --engine server"]),
        ("audit", ["--max-new-tokens", "8"], ["--max-new-tokens is read only by specbench run", "specbench audit"]),
        ("audit", ["--temperature", "1"], ["--temperature is read only by specbench run", "--setting"]),
    ],
)
def test_an_option_the_run_does_not_read_is_one_line_before_anything_loads(command, args, needles, tmp_path):
    out = tmp_path / "run"
    result = cli(command, *args, "--out", str(out))
    one_line_error(result, *needles)
    assert result.returncode == 2 and not out.exists()


def test_a_file_given_to_a_built_in_dataset_is_refused_at_once_not_ignored(prompts_file, tmp_path):
    """Issue 73: --dataset-path with HumanEval (the default) decoded HumanEval and exited 0. A fresh
    process, as a user starts it, refuses it in one line in well under 5 seconds, and says how to give the file."""
    began = time.monotonic()
    result = specbench("run", "--dataset-path", prompts_file, "--out", str(tmp_path / "run"))
    assert time.monotonic() - began < 5
    one_line_error(result, "--dataset-path", "not by --dataset humaneval", "--dataset FILE")
    assert result.returncode == 2 and not (tmp_path / "run").exists()


def test_hf_assisted_refuses_unequal_widths(tiny_pair, padded_draft, prompts_file, tmp_path):
    pair = ["--target", tiny_pair[0], "--draft", padded_draft]
    result = cli("run", *pair, "--dataset", prompts_file, "--method", "hf-assisted", "--out", str(tmp_path / "run"))
    one_line_error(result, "hf-assisted")


def test_empty_dataset_and_foreign_tokenizer(tiny_pair, foreign_draft, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = ["--out", str(tmp_path / "run")]
    one_line_error(cli_on_tiny_pair("run", tiny_pair, "--dataset", str(empty), *out), "no prompts")
    one_line_error(cli("run", "--target", tiny_pair[0], "--draft", foreign_draft, *out), "tokenizers of")


@pytest.mark.slow
def test_sweep_shares_one_baseline_and_writes_the_sweep_files(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "sweep"
    result = cli_on_tiny_pair(
        "sweep-k",
        tiny_pair,
        "--ks",
        "3,1,2",
        "--dataset",
        prompts_file,
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "20",
        "--cost-repeats",
        "2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv")
    summary = summary[summary["method"] == "speculative"].reset_index()
    assert summary["k"].tolist() == [1, 2, 3]
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sum(o["method"] == "baseline" for o in outputs) == 2  # once per prompt, not per K
    assert len(pd.read_csv(out / "records.csv")) == 2 * (1 + 3)
    # Every K's records refer to the same baseline timing of each prompt.
    records = pd.read_csv(out / "records.csv")
    assert records.groupby("prompt_id")["baseline_s"].nunique().eq(1).all()
    acceptance = pd.read_csv(out / "acceptance.csv")
    assert acceptance.groupby("k")["position"].max().to_dict() == {1: 1, 2: 2, 3: 3}
    assert (acceptance.groupby("k")["acceptance"].apply(lambda a: a.is_monotonic_decreasing)).all()
    costs = pd.read_csv(out / "verify_cost.csv")
    verify = costs[costs["model"] == "target"]
    assert verify["tokens"].tolist() == list(range(1, 9))  # the whole curve, beyond the largest K + 1
    assert (verify[["iqr_s", "ratio_iqr"]] >= 0).all().all() and (verify["repeats"] == 2).all()
    draft_step = (
        costs.loc[costs["model"] == "draft", "seconds"].item() / verify.loc[verify["tokens"] == 1, "seconds"].item()
    )
    assert summary["c"].eq(summary["c"].iloc[0]).all() and summary["c"].iloc[0] == pytest.approx(draft_step)
    for _, row in summary.iterrows():
        ratio = verify.loc[verify["tokens"] == row["k"] + 1, "ratio"].item()
        assert row["verify_ratio"] == pytest.approx(ratio)
    best = json.loads((out / "best_k.json").read_text())["speculative"]
    assert best["measured"]["k"] == summary.loc[summary["speedup"].idxmax(), "k"]
    assert best["predicted_verify"]["k"] == summary.loc[summary["predicted_speedup_verify"].idxmax(), "k"]
    (out / "sweep.png").unlink()
    assert cli("plot", str(out)).returncode == 0
    assert (out / "sweep.png").stat().st_size > 10_000


def test_theory_command_prints_the_optimum():
    result = cli("theory", "--alpha", "0.8", "--c", "0.05", "--ks", "4", "--format", "csv")
    assert result.returncode == 0
    assert result.stdout.splitlines()[1].startswith("0.8,0.05,4,3.3616")
    assert "2.801" in result.stdout.splitlines()[1]


def test_theory_names_an_optimum_beyond_the_ks_it_was_given(tmp_path):
    shown = cli("theory", "--alpha", "0.9", "--c", "0.02")
    assert shown.returncode == 0 and "optimal K = 8 with speedup 5.281" in shown.stdout
    assert "beyond --k: K = 19 gives 6.365, the best of every K" in shown.stdout
    assert "beyond --k" not in cli("theory", "--alpha", "0.6", "--c", "0.1").stdout  # K = 3 is in 1..8
    assert "no K is best" in cli("theory", "--alpha", "0.5", "--c", "0").stdout
    one_line_error(cli("theory", "--costs", str(tmp_path / "nowhere")), "nowhere does not exist", "verify_cost.csv")


def test_theory_refuses_a_cost_that_is_not_a_number(tmp_path):
    for c in ("nan", "inf"):
        one_line_error(cli("theory", "--alpha", "0.8", "--c", c), "a finite --c >= 0")
    costs = tmp_path / "verify_cost.csv"
    header = "model,tokens,context_tokens,seconds,iqr_s,ratio,ratio_iqr,repeats\n"
    costs.write_text(header + "target,1,64,0.02,0,1,0,3\ndraft,1,64,nan,0,nan,0,3\n")
    one_line_error(cli("theory", "--alpha", "0.8", "--costs", str(costs)), "not a positive number")
    costs.write_text(header + "target,1,64,0.02,0,1,0,3\ndraft,1,64,0.002,0,0.1,0,3\n")
    one_line_error(cli("theory", "--alpha", "0.8", "--costs", str(costs)), "no target forward of 2 tokens")
    costs.write_text(costs.read_text() + "target,2,64,0.022,0,1.1,0,3\n")
    shown = cli("theory", "--alpha", "0.8", "--costs", str(costs), "--format", "csv")
    assert shown.returncode == 0 and shown.stdout.count("\n") == 2  # a header and K = 1


def test_every_method_matches_the_greedy_baseline(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "methods"
    result = cli_on_tiny_pair(
        "run",
        tiny_pair,
        "--k",
        "3",
        "--dataset",
        prompts_file,
        "--method",
        "speculative,prompt-lookup",
        "--method",
        "cascade",
        "--method",
        "hf-assisted",
        "--method",
        "hf-generate",
        "--max-new-tokens",
        "24",
        "--cost-repeats",
        "2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv")
    methods = ["baseline", "speculative", "prompt-lookup", "cascade", "hf-generate", "hf-assisted"]
    assert summary["method"].tolist() == methods
    assert (summary["outputs_match"] == 3).all() and (summary["first_divergence"] == -1).all()
    records = pd.read_csv(out / "records.csv")
    assert len(records) == 3 * len(methods) and records["outputs_match"].all()
    # Every method's decode time is split into phases that add up to its wall time.
    phases = records[list(schema.PHASES)]
    assert (phases >= 0).all().all() and (phases["prefill_s"] > 0).all() and (phases["verify_s"] > 0).all()
    assert ((phases.sum(axis=1) - records["method_s"]).abs() <= 0.02 * records["method_s"]).all()
    drafting = records.set_index("method")["draft_s"]
    assert (drafting[["speculative", "cascade", "hf-assisted"]] > 0).all()
    assert (drafting[["baseline", "prompt-lookup"]] == 0).all()
    by_method = summary.set_index("method")
    for method in ("speculative", "prompt-lookup", "cascade", "hf-assisted"):
        assert 1 <= by_method.loc[method, "tau"] <= 4  # measured for every drafting method
        assert 0 <= by_method.loc[method, "acceptance_rate"] <= 1
    assert by_method.loc["baseline", "speedup"] == 1.0
    # A round drafts at most K = 3. transformers' assistant drafts before the target's first call, which
    # verifies them with the prompt; counting that call as a prefill that verifies nothing divided T
    # forwards' drafts by T - 1 (3.6 for hf-assisted here).
    for method in ("speculative", "cascade", "hf-assisted"):
        nodes = [*records.loc[records["method"] == method, "nodes"], summary.set_index("method").loc[method, "nodes"]]
        assert all(0 < n <= 3 for n in nodes), (method, nodes)
    # hf-assisted's c is of transformers' forwards; the verification cost measured is of specbench's own.
    assert by_method.loc["speculative", "verify_ratio"] > 0 and math.isnan(by_method.loc["hf-assisted", "verify_ratio"])
    # hf-assisted's speedup is over transformers' own plain generate, its vs_specbench over specbench's baseline.
    hf = records[records["method"] == "hf-assisted"].set_index("prompt_index")
    plain = records[records["method"] == "hf-generate"].set_index("prompt_index")
    assert (hf["baseline_s"] == plain["method_s"]).all()
    assert by_method.loc["hf-assisted", "vs_specbench"] == pytest.approx(
        by_method.loc["hf-assisted", "spec_tokens_per_s"] / by_method.loc["baseline", "spec_tokens_per_s"]
    )
    assert "every method equals the baseline" in result.stdout


def test_distill_makes_a_loadable_draft_and_resumes(tiny_pair, tmp_path):
    from specbench.training.distill import DistillConfig, distill

    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "lib.py").write_text(
        (
            'def add_up(a: int, b: int) -> int:\n    """Add two numbers and return their sum, whatever their type."""\n    return a + b\n\n\n'
            'def greet(name):\n    """Say hello to someone by name, on standard output, then return."""\n    print("hello " + name)\n\n\n'
            # Named like a HumanEval problem: never a training prompt.
            'def has_close_elements(numbers, threshold):\n    """Check if any two numbers are closer than threshold."""\n'
        )
        * 6
    )
    from specbench.training.distill_data import function_stubs
    from specbench.workloads.sources import source_files

    stubs = function_stubs(source_files([str(sources)]), 0, 100, frozenset({"has_close_elements"}))
    assert len(stubs) == 12 and all("has_close" not in s for s in stubs)
    assert all(s.startswith("def add_up") for s in stubs[:6])  # annotated signatures first
    target = load(tiny_pair[0], CPU, F32)
    cfg = DistillConfig(
        out=tmp_path / "draft",
        hidden_size=32,
        layers=1,
        heads=4,
        kv_heads=2,
        intermediate_size=64,
        seq_len=32,
        teacher_tokens=256,
        teacher_batch=4,
        top_k=8,
        epochs=2,
        batch=2,
        save_every=2,
        sources=[str(sources)],
        generate_prompts=3,
        generate_new_tokens=8,
        generate_batch=2,
    )
    phases = [p.phase for p in distill(cfg, target)]
    assert {"teacher:teacher", "generate", "student"} <= set(phases)
    # The stored distribution at answer token j is the one that token came from: for greedy
    # answers its top entry is the token itself.
    for doc in torch.load(cfg.out / "generated" / "0000.pt"):
        assert doc["top_idx"][:, 0].tolist() == doc["ids"][doc["prompt_len"] :].tolist()
    from safetensors import safe_open

    with safe_open(cfg.out / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float16}
    draft = load(str(cfg.out), CPU, F32)
    assert shared_width(target, draft) == target.width
    assert (draft.tokenizer.padding_side, draft.tokenizer.pad_token) == (
        target.tokenizer.padding_side,
        target.tokenizer.pad_token,
    )
    # The shortlist is every token the teacher ranked first in the training data.
    answer_tops = {
        t
        for path in (cfg.out / "generated").glob("*.pt")
        for doc in torch.load(path)
        for t in doc["top_idx"][:, 0].tolist()
    }
    assert draft.head_tokens is not None and set(draft.head_tokens.tolist()) <= set(range(target.width))
    assert len(set(draft.head_tokens.tolist()) & answer_tops) > 0
    assert 0.0 <= json.loads((cfg.out / "distill.json").read_text())["held_out_greedy_agreement"] <= 1.0
    # A second run finds every shard and the finished training state: nothing is recomputed.
    assert [p.phase for p in distill(cfg, target)].count("student") == 0
    # Training can go on from a draft; its shape wins over the size options.
    more = dataclasses.replace(cfg, out=tmp_path / "more", init=str(cfg.out), hidden_size=64, epochs=1)
    assert "student" in {p.phase for p in distill(more, target)}
    assert load(str(more.out), CPU, F32).model.config.hidden_size == 32
    recipe = json.loads((more.out / "distill.json").read_text())
    assert recipe["hidden_size"] == recipe["init_recipe"]["hidden_size"] == 32


@pytest.mark.slow
def test_tree_methods_run_several_shapes_and_equal_the_greedy_baseline(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "trees"
    result = cli_on_tiny_pair(
        "run",
        tiny_pair,
        "--method",
        "tree,lookup-tree,speculative",
        "--tree",
        "2,2",
        "--tree",
        "3,1,1",
        "--k",
        "2",
        "--dataset",
        prompts_file,
        "--max-new-tokens",
        "20",
        "--cost-repeats",
        "2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv", dtype={"tree": str})
    trees = summary[summary["tree"].notna()]
    assert sorted(zip(trees["method"], trees["tree"], trees["k"], strict=True)) == [
        ("lookup-tree", "2,2", 2),
        ("lookup-tree", "3,1,1", 3),
        ("tree", "2,2", 2),
        ("tree", "3,1,1", 3),
    ]
    assert (summary["outputs_match"] == summary["num_prompts"]).all()  # greedy: every shape is exact
    drafted = summary.set_index(["method", "tree"]).loc[("tree", "2,2")]
    assert drafted["nodes"] == 6 and drafted["tau"] >= 1  # a full 2,2 tree every round
    acceptance = pd.read_csv(out / "acceptance.csv", dtype={"tree": str})
    ranks = acceptance[(acceptance["by"] == "rank") & (acceptance["method"] == "tree")]
    assert not ranks.empty and ranks.groupby("tree")["acceptance"].sum().round(9).eq(1).all()
    costs = pd.read_csv(out / "verify_cost.csv")
    assert costs.loc[costs["model"] == "target", "tokens"].max() == 10  # the 3,1,1 tree's 9 nodes + its root
    assert (out / "sweep.png").stat().st_size > 10_000


def test_methods_of_two_levels_report_each_level(tiny_pair, prompts_file, tmp_path):
    # cascade: lookup beneath the draft model (and alone after --cascade-split); lookup-or-draft:
    # lookup beside the draft model, whole rounds of up to --lookup-k tokens for the target.
    out = tmp_path / "levels"
    result = cli_on_tiny_pair(
        "run",
        tiny_pair,
        "--method",
        "speculative,cascade,lookup-or-draft",
        "--k",
        "3",
        "--cascade-split",
        "2",
        "--lookup-k",
        "5",
        "--lookup-ngram",
        "3",
        "--dataset",
        prompts_file,
        "--max-new-tokens",
        "24",
        "--cost-repeats",
        "2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    cascade, speculative = summary.loc["cascade"], summary.loc["speculative"]
    assert cascade["options"] == "cascade_split=2" and pd.isna(speculative["options"])
    assert cascade["outputs_match"] == 3
    assert (
        0 < cascade["inner_accepted"] <= cascade["inner_drafted"] and 0 < cascade["from_inner"] <= cascade["accepted"]
    )
    assert speculative[["inner_drafted", "inner_accepted", "from_inner", "inner_forwards"]].isna().all()
    assert cascade["inner_forwards"] == 0  # prompt lookup runs no model
    assert cascade["inner_s"] > 0 and speculative["inner_s"] == 0  # lookup's own time, a phase of its own
    assert cascade["draft_forwards"] < speculative["draft_forwards"]  # lookup spares the draft model forwards
    assert "levels:" in result.stdout and "inner ms" in result.stdout

    beside = summary.loc["lookup-or-draft"]
    assert beside["options"] == "lookup_k=5,lookup_ngram=3" and beside["outputs_match"] == 3
    assert (
        0 < beside["from_inner"] <= beside["accepted"] and beside["inner_drafted"] > 0 and beside["draft_forwards"] > 0
    )
    assert pd.isna(beside["predicted_speedup"])  # its rounds are not chains of K: the chain formula does not apply
    lengths = pd.read_csv(out / "draft_lengths.csv")
    assert lengths.loc[lengths["method"] == "lookup-or-draft", "drafted"].max() <= 5  # lookup's longest, not K
    costs = pd.read_csv(out / "verify_cost.csv")
    assert costs.loc[costs["model"] == "target", "tokens"].max() >= 6  # lookup's 5 tokens and the newest one


def test_hf_assisted_c_is_timed_on_the_eager_forwards_generate_runs(tiny_pair, prompts_file, tmp_path):
    """transformers' generate runs the modules' eager forward: hf-assisted's c is the eager draft's
    one-token forward over the eager target's (their verify_cost.csv rows), while specbench's loop
    keeps the ratio of its own forwards."""
    out = tmp_path / "run"
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--method", "speculative,hf-assisted", "--dataset", prompts_file, "--num-prompts", "1",
        "--k", "2", "--max-new-tokens", "6", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    costs = pd.read_csv(out / "verify_cost.csv").query("tokens == 1").set_index("model")["seconds"]
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert summary.loc["hf-assisted", "c"] == pytest.approx(costs["eager-draft"] / costs["eager-target"], rel=1e-6)
    assert summary.loc["speculative", "c"] == pytest.approx(costs["draft"] / costs["target"], rel=1e-6)
