"""--synthetic-acceptance: drafts kept at a given rate instead of verified (benchmarking only, not
exact). The number a round keeps follows the law the rate sets, the token after them is the
target's own, a length is turned into the rate that gives it, and every place that cannot take it
refuses it in one line."""

import csv
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specbench.bench.config import BenchConfig
from specbench.bench.serve import ServingRun
from specbench.decoding import sampling
from specbench.decoding.decode import Draft, verify
from specbench.decoding.sampling import Sampling, synthetic_rate, synthetic_rates
from specbench.engines.vllm import EngineSpec

from ..helpers import cli, cli_on_tiny_pair, one_line_error

K, VOCAB = 4, 6
DRAFTS = torch.tensor([1, 2, 3, 4])


def kept_counts(rule, rate: float, draws: int = 20_000) -> np.ndarray:
    """How many drafts ``rule`` kept in each of ``draws`` rounds, as a histogram over 0..K."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(K + 1, VOCAB, generator=torch.Generator().manual_seed(1))
    setting = Sampling(synthetic_acceptance=rate)
    kept = [rule(DRAFTS, logits, setting, generator).accepted for _ in range(draws)]
    return np.bincount(kept, minlength=K + 1)


def truncated_geometric(rate: float) -> np.ndarray:
    """P(n drafts kept): each kept with probability ``rate`` while all before it were."""
    return np.array([rate**n * (1 - rate) for n in range(K)] + [rate**K])


@pytest.mark.parametrize("rate", [0.3, 0.7, 0.9])
def test_a_round_keeps_drafts_by_the_law_the_rate_sets(rate):
    counts = kept_counts(sampling.verify_chain_synthetic, rate)
    assert chisquare(counts, truncated_geometric(rate) * counts.sum()).pvalue > 1e-3


def test_the_test_catches_a_rule_that_keeps_each_draft_apart(monkeypatch):
    def each_apart(draft_tokens, target_logits, setting, generator):  # keeps a draft after a dropped one
        rate = synthetic_rate(setting.synthetic_acceptance, len(draft_tokens))
        kept = int((torch.rand(len(draft_tokens), generator=generator) < rate).sum())
        return sampling.Verdict(list(range(kept)), target_logits[kept].argmax().view(1), 0.0, 0)

    counts = kept_counts(each_apart, 0.7)
    assert chisquare(counts, truncated_geometric(0.7) * counts.sum()).pvalue < 1e-6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_token_after_the_kept_drafts_is_the_targets_and_alpha_is_the_rate(temperature):
    logits = torch.full((K + 1, VOCAB), -5.0)
    logits[torch.arange(K + 1), torch.tensor([5, 5, 5, 5, 0])] = 5.0  # the target never wants a draft
    setting = Sampling(temperature=temperature, synthetic_acceptance=0.6)
    generator, tested, beta = torch.Generator().manual_seed(0), 0, 0.0
    for _ in range(200):
        verdict, _ = verify(Draft.chain(DRAFTS, None), logits, setting, generator)
        n = verdict.accepted
        assert verdict.emitted_ids[:n] == DRAFTS[:n].tolist()
        if temperature == 0:
            assert verdict.emitted_ids[n] == (0 if n == K else 5)
        tested, beta = tested + verdict.tested, beta + verdict.beta_sum
    assert beta / tested == pytest.approx(0.6)


def test_a_length_is_the_mean_of_tokens_per_round_at_its_rate():
    for length, k in [(1.0, 3), (2.5, 4), (3.2, 3), (5.0, 4)]:
        rate = synthetic_rate(length, k)
        assert sum(rate**i for i in range(k + 1)) == pytest.approx(length, abs=1e-9)
    assert synthetic_rates(0.5, 3) == [0.5, 0.25, 0.125]  # what llama.cpp's --spec-synth-rates takes
    with pytest.raises(ValueError, match="at most 3"):
        synthetic_rate(3.5, 2)
    # A round shorter than the length allows (a decode's last, a short lookup) keeps every draft.
    short = sampling.verify_chain_synthetic(DRAFTS[:1], torch.zeros(2, VOCAB), Sampling(synthetic_acceptance=3.0), None)
    assert short.accepted == 1 and short.beta_sum == 1.0


def test_a_tree_is_refused():
    with pytest.raises(ValueError, match="a tree"):
        verify(Draft(DRAFTS, [-1, 0, 0, 1], None), torch.zeros(K + 1, VOCAB), Sampling(synthetic_acceptance=0.5), None)


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--synthetic-acceptance", "0.5", "--method", "tree"], ["--method tree", "chain"]),
        (["--synthetic-acceptance", "0.5", "--method", "cascade"], ["--method cascade"]),
        (["--synthetic-acceptance", "0.5", "--method", "online"], ["--method online learns"]),
        (["--synthetic-acceptance", "6", "--k", "4"], ["K = 4", "at most 5"]),
        (["--synthetic-acceptance", "-1"], ["--synthetic-acceptance must be >= 0"]),
        (
            ["--synthetic-acceptance", "0.5", "--engine", "server", "--baseline-url", "http://127.0.0.1:9/v1"],
            ["--engine server", "--spec-synth-rates"],
        ),
    ],
)
def test_where_it_cannot_apply_it_is_one_line(args, needles):
    one_line_error(cli("run", *args), *needles)


def test_vllm_gets_its_synthetic_sampler_with_the_loops_rates_and_a_cpu_is_refused(tiny_pair, tmp_path, monkeypatch):
    """vLLM's synthetic rejection sampler takes unconditional rates per position, as llama-server does:
    the same law as the loop's. Its CPU sampler refuses it, so a run without CUDA stops in one line."""
    cfg = BenchConfig(engines=["vllm"], methods=["draft"], ks=[3], synthetic_acceptance=2.5)
    run = ServingRun("vllm", cfg.served_baseline, cfg.served_plan, cfg.loads, cfg.requests([]), 0, tmp_path)
    run.target, run.draft = EngineSpec(model="t", dtype="float32", seed=0, max_model_len=64, max_num_seqs=1), "d"
    speculative = run.spec(cfg.served_plan[0]).speculative
    assert speculative["rejection_sample_method"] == "synthetic"
    assert speculative["synthetic_acceptance_rates"] == pytest.approx(synthetic_rates(2.5, 3))
    assert run.spec(cfg.served_baseline).speculative is None  # the baseline verifies nothing
    out = tmp_path / "run"
    monkeypatch.setattr("specbench.bench.config.available", lambda: True)  # refused before vLLM would be imported
    refused = cli_on_tiny_pair("run", tiny_pair, "--engine", "vllm", "--synthetic-acceptance", "0.5", "--out", out)
    one_line_error(refused, "--engine vllm needs a GPU")
    assert not out.exists()


def test_the_audit_refuses_it():
    one_line_error(cli("audit", "--synthetic-acceptance", "0.5"), "--synthetic-acceptance", "exact")


def test_a_run_marks_its_rows_and_compares_no_outputs(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    args = ["--synthetic-acceptance", "0.5", "--k", "2", "--dataset", prompts_file, "--max-new-tokens", "16"]
    result = cli_on_tiny_pair("run", tiny_pair, *args, "--warmup", "0", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "greedy outputs: not compared (--synthetic-acceptance" in result.stdout
    rows = {row["method"]: row for row in csv.DictReader((out / "summary.csv").open())}
    assert {row["synthetic_acceptance"] for row in rows.values()} == {"0.5"}
    assert float(rows["speculative"]["alpha"]) == pytest.approx(0.5)  # beta is the rate at every tested draft
    # Its outputs are not the target's: no count of equal ones (a hunt saw "= base 0" beside alpha 0.5), and
    # the caption says how they were kept, here and in show.
    assert all(math.isnan(float(rows["speculative"][name])) for name in ("outputs_match", "structural"))
    caption = "drafts kept unverified at synthetic acceptance 0.5"
    assert caption in " ".join(result.stdout.split())
    assert caption in " ".join(cli("show", str(out)).stdout.split())


def test_the_caption_says_a_length_where_the_value_is_one():
    # From 1 up the value is a mean length: 1 is a rate of 0, which "synthetic acceptance 1" read as all kept.
    from types import SimpleNamespace

    from specbench.bench.run import run_title

    pair, prompts = SimpleNamespace(draft=True), SimpleNamespace(first=[1, 2], turns=[1, 2])
    titles = [run_title(BenchConfig(synthetic_acceptance=rate), pair, prompts) for rate in (0.8, 1.0, 2.5)]
    assert [title.split("synthetic acceptance ")[1] for title in titles] == [
        "0.8",
        "1 token a round",
        "2.5 tokens a round",
    ]
