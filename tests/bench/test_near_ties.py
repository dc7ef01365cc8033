"""Greedy divergences from the baseline in specbench's own loop, labelled near-tie (the target's two
likeliest tokens within what numerics can flip) or structural (a losslessness bug), in records.csv,
in the summary's `structural` and in the run's closing lines."""

import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from specbench.audit.bugs import miscounted_verify
from specbench.bench.config import BenchConfig
from specbench.bench.run import Results, benchmark, prepare
from specbench.decoding.decode import verify
from specbench.engines.loop import Loop
from specbench.methods.base import Decoder, SpeculativeLoop
from specbench.methods.registry import BASELINE
from specbench.results.report import greedy_lines
from specbench.results.serving import NEAR_TIE
from specbench.results.summary import structural

from ..helpers import build_llama, build_tokenizer


def config(pair, prompts_file, **options) -> BenchConfig:
    options = {
        "target": pair[0],
        "draft": pair[1],
        "dataset": prompts_file,
        "device": "cpu",
        "max_new_tokens": 16,
        "cost_repeats": 1,
        "warmup": 0,
        "methods": ["speculative"],
        "ks": [3],
        **options,
    }
    return BenchConfig(**options)


def run(cfg: BenchConfig, out: Path) -> tuple[Results, pd.DataFrame]:
    results = [event for event in benchmark(cfg, out) if isinstance(event, Results)][0]
    return results, pd.read_csv(out / "records.csv", keep_default_na=False)


def parted(records: pd.DataFrame) -> pd.DataFrame:
    return records[records["first_divergence"].astype(int) >= 0]


@pytest.fixture(scope="module")
def faint_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft): untied random Llamas at their default initialisation, the target's head scaled
    up so that its logits are as large as a real model's (30-50) while its two likeliest tokens are
    often close. In bfloat16 its K+1-token verification and its one-token step round them
    differently, so greedy outputs part from the baseline's at near-ties (3 of the outputs below on
    the machine this was written on, one of them 0.25 nats apart: 1 rounding step at 50)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("faint")
    tokenizer = build_tokenizer(root / "tok")
    target = build_llama(root / "target", tokenizer, layers=4, hidden=64, seed=0, tie=False, scale=1.0)
    draft = build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=1, tie=False, scale=1.0)
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100)
    model.save_pretrained(target)
    return str(target), str(draft)


def test_bfloat16_numerics_part_greedy_outputs_at_near_ties_only(faint_pair, prompts_file, tmp_path):
    methods = ["speculative", "prompt-lookup", "hf-assisted"]  # hf-assisted is held to hf-generate's answers
    cfg = replace(config(faint_pair, prompts_file, dtype="bfloat16", methods=methods, ks=[4]), max_new_tokens=64)
    results, records = run(cfg, tmp_path)
    diverged = parted(records)
    assert len(diverged), "the bfloat16 pair no longer parts from the baseline: nothing here is labelled"
    assert set(diverged["divergence"]) == {"near-tie"}
    assert set(records.loc[records["first_divergence"].astype(int) < 0, "divergence"]) == {""}
    assert [row["structural"] for row in results.summary] == [0] * 5
    lines = greedy_lines(results.summary)
    assert lines[0] == "greedy outputs: no structural divergence from the baseline"
    assert lines[1].startswith(f"near-ties, not failures: {len(diverged)} greedy outputs parted")
    # Some of them are further apart than NEAR_TIE: what makes them near-ties is bfloat16's rounding step.
    pair, conversations = prepare(cfg)
    loop = Loop(pair, Decoder(BASELINE))
    outputs = pd.read_json(tmp_path / "outputs.jsonl", lines=True)
    answers = outputs[outputs["method"] == "baseline"].set_index("prompt_index")["token_ids"]
    margins = []
    for index, at in diverged.loc[diverged["method"] != "hf-assisted", ["prompt_index", "first_divergence"]].values:
        first, second, _ = loop.top_two(conversations.first[index], int(at), answers[index])
        margins.append(first - second)
    assert max(margins) > NEAR_TIE


def last_on_tie(draft, target_logits, cfg, generator, seen=None):
    """verify(), its argmax taking the last of equal logits instead of the first (as another kernel's
    reduction may): verification over the vocabulary reversed, its token mapped back."""
    end = target_logits.shape[-1] - 1
    verdict, p = verify(replace(draft, tokens=end - draft.tokens), target_logits.flip(-1), cfg, generator, seen)
    return replace(verdict, next_token=end - verdict.next_token), p


@pytest.fixture(scope="module")
def twin_rows_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft): a tied Llama whose token 2i + 1 has token 2i's row, so that at every position
    its two likeliest tokens tie exactly, and a draft."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("twins")
    tokenizer = build_tokenizer(root / "tok")
    target = build_llama(root / "target", tokenizer, layers=2, hidden=64, seed=0)
    draft = build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=1)
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight  # tied: the input embedding too
        pairs = weight.shape[0] // 2 * 2
        weight[1:pairs:2] = weight[0:pairs:2]
    model.save_pretrained(target)
    return str(target), str(draft)


def test_an_exact_tie_broken_the_other_way_is_a_near_tie_of_margin_zero(
    twin_rows_pair, tmp_path, prompts_file, monkeypatch
):
    # specbench's argmax takes the first of two equal logits everywhere, so only a verification that
    # takes the other parts the outputs: at the first token it verifies, where the margin is 0.
    monkeypatch.setattr(SpeculativeLoop, "rule", staticmethod(last_on_tie))
    cfg = config(twin_rows_pair, prompts_file)
    results, records = run(cfg, tmp_path)
    spec = records[records["method"] == "speculative"]
    assert list(spec["first_divergence"]) == [1, 1, 1] and list(spec["divergence"]) == ["near-tie"] * 3
    assert results.summary[1]["structural"] == 0
    # The margin there: the target's two largest logits after the prompt and the baseline's first token.
    pair, conversations = prepare(cfg)
    loop = Loop(pair, Decoder(BASELINE))
    outputs = pd.read_json(tmp_path / "outputs.jsonl", lines=True)
    answers = outputs[outputs["method"] == "baseline"].set_index("prompt_index")["token_ids"]
    for index in range(3):
        first, second, _ = loop.top_two(conversations.first[index], 1, answers[index])
        assert first == second


def test_an_output_cut_short_is_structural_whatever_the_margin(twin_rows_pair, tmp_path, prompts_file, monkeypatch):
    # Every margin of this target is 0, yet an output that ends one token early (as a method that
    # stops where it should not would) is no near-tie: nothing rounded differently.
    decode = SpeculativeLoop.decode

    def cut_short(self, *args, **kwargs):
        result = decode(self, *args, **kwargs)
        return replace(result, tokens=result.tokens[:-1])

    monkeypatch.setattr(SpeculativeLoop, "decode", cut_short)
    _, records = run(config(twin_rows_pair, prompts_file), tmp_path)
    spec = records[records["method"] == "speculative"]
    assert list(spec["first_divergence"]) == [15] * 3 and list(spec["divergence"]) == ["structural"] * 3


def test_a_divergence_without_a_label_is_neither_counted_nor_passed():
    # Under a repetition penalty (or from a server without logprobs) a divergence has no label: the
    # summary cannot say how many are structural, and the run does not call the outputs equal.
    rows = [{"first_divergence": -1, "divergence": ""}, {"first_divergence": 3, "divergence": "near-tie"}]
    assert structural(rows) == 0
    assert math.isnan(structural([*rows, {"first_divergence": 5, "divergence": ""}]))
    row = {"method": "speculative", "k": 2, "tree": "", "k_policy": "fixed", "engine": "torch", "concurrency": 1}
    summary = [{**row, "num_prompts": 3, "outputs_match": 1, "structural": math.nan}]
    assert greedy_lines(summary) == [
        "greedy outputs differing from the baseline with no label (no margin was taken): speculative K=2 (2)"
    ]


def test_a_broken_verification_diverges_structurally_and_the_run_names_it(
    tiny_pair, untied_target, prompts_file, tmp_path, monkeypatch
):
    # The audit's accept-miscount bug (transformers #28508): a rejected draft is kept. The draft mostly
    # mispredicts this target, whose logits are far apart (scaled up): no near-tie explains what parts.
    from typer.testing import CliRunner

    from specbench.cli.app import app

    monkeypatch.setattr(SpeculativeLoop, "rule", staticmethod(miscounted_verify))
    out = tmp_path / "run"
    args = ["run", "--target", untied_target, "--draft", tiny_pair[1], "--dataset", prompts_file, "--device", "cpu"]
    args += ["--k", "3", "--max-new-tokens", "16", "--cost-repeats", "1", "--warmup", "0", "--out", str(out)]
    shown = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    records = pd.read_csv(out / "records.csv", keep_default_na=False)
    assert set(parted(records)["method"]) == {"speculative"} and set(parted(records)["divergence"]) == {"structural"}
    n = len(parted(records))
    assert (
        f"greedy outputs with structural divergences from the baseline (not lossless): speculative K=3 ({n} of 3)"
        in (" ".join(shown.output.split()))
    )
    assert pd.read_csv(out / "summary.csv")["structural"].tolist() == [0, n]


@pytest.mark.gpu
def test_bfloat16_greedy_on_cuda_has_no_structural_divergence(
    faint_pair, untied_target, tiny_pair, prompts_file, tmp_path
):
    # Only a GPU shows this: its K+1-token and one-token forwards run other kernels than a CPU's, and
    # whatever they part on must be a near-tie. On both pairs: small logits, and scaled-up ones.
    for n, pair in enumerate([faint_pair, (untied_target, tiny_pair[1])]):
        cfg = config(pair, prompts_file, device="cuda", dtype="bfloat16", methods=["speculative", "prompt-lookup"])
        results, records = run(replace(cfg, max_new_tokens=64, ks=[4]), tmp_path / str(n))
        assert set(parted(records)["divergence"]) <= {"near-tie"}
        assert all(row["structural"] == 0 for row in results.summary)
