"""Thinking apart from answering (core/thinking.py): labels, the split of forwards and seconds, and the
columns records.csv and summary.csv take from them, against figures worked out by hand."""

import math

import pandas as pd
import pytest

from specbench.core import thinking
from specbench.core.thinking import Emitted, Markers, Span

from ..helpers import check_thinking_split, cli, one_line_error

OPEN, CLOSE = 5, 6
MARKERS = Markers(OPEN, CLOSE)


def test_labels_run_from_an_open_marker_through_its_close_marker():
    assert MARKERS.labels([1, 5, 2, 6, 3]) == [False, True, True, True, False]
    # A second span, and a close marker outside any span (nothing to close: answering).
    assert MARKERS.labels([5, 6, 1, 6, 5, 2]) == [True, True, False, False, True, True]
    # A chat template that opens the span in the prompt: the answer starts inside it.
    assert MARKERS.labels([1, 2, 6, 3], inside=True) == [True, True, True, False]


def test_an_answer_starts_inside_where_the_prompts_last_marker_opens_a_span():
    assert MARKERS.starts_inside([1, 5])
    assert MARKERS.starts_inside([5, 1, 2])
    assert not MARKERS.starts_inside([5, 6, 1])
    assert not MARKERS.starts_inside([1, 2])


# An answer of 7 tokens: the prefill's token (answering), then a round that drafted 3 and kept 2 (from
# the open marker on: thinking), one that kept 1 (from the close marker: thinking, its second token
# answering) and a last one cut after its first token by the token limit.
TOKENS = [1, 5, 2, 3, 6, 7, 8]
STEPS = [(0, 0), (3, 2), (3, 1), (3, 3)]
ENDS = [0.1, 0.3, 0.5, 0.7]


def test_forwards_go_to_the_span_of_their_first_token_and_seconds_to_each_tokens_arrival():
    times = thinking.arrivals(STEPS, ENDS, 0.8, len(TOKENS))
    # The last token comes when the decode ends (0.8), not when its forward did.
    assert times == [0.1, 0.3, 0.3, 0.3, 0.5, 0.5, 0.8]
    spans = thinking.split(TOKENS, MARKERS.labels(TOKENS), STEPS, times)
    assert spans["thinking"] == Span(tokens=4, forwards=2, drafted=6, accepted=3, seconds=pytest.approx(0.4))
    assert spans["answer"] == Span(tokens=3, forwards=2, drafted=3, accepted=3, seconds=pytest.approx(0.4))
    # The spans add up to the whole answer.
    assert sum(span.seconds for span in spans.values()) == pytest.approx(0.8)
    assert sum(span.forwards for span in spans.values()) == len(STEPS)


def test_counts_that_do_not_fit_the_tokens_are_unknown_not_guessed():
    # vLLM reports only the steps that drafted: one step too few cannot be placed.
    assert not thinking.aligned(STEPS[:-1], len(TOKENS))
    assert not thinking.aligned(STEPS + [(3, 0)], len(TOKENS))
    assert thinking.arrivals(STEPS[:-1], ENDS[:-1], 0.8, len(TOKENS)) is None
    spans = thinking.split(TOKENS, MARKERS.labels(TOKENS), STEPS[:-1], None)
    for span in spans.values():
        assert math.isnan(span.forwards) and math.isnan(span.accepted) and math.isnan(span.seconds)
    assert spans["thinking"].tokens == 4 and spans["answer"].tokens == 3  # the labels need only the tokens


def test_columns_of_a_record_and_of_a_summary():
    mine = Emitted(TOKENS, STEPS, thinking.arrivals(STEPS, ENDS, 0.8, len(TOKENS)))
    # The baseline: one token a forward, 0.1 s each.
    base = Emitted(TOKENS, [(0, 0)] * len(TOKENS), [0.1 * (n + 1) for n in range(len(TOKENS))])
    row = thinking.record_columns(MARKERS, [9], mine, base)
    assert row["thinking_acceptance"] == 0.5 and row["answer_acceptance"] == 1.0
    assert row["thinking_tau"] == 2.5 and row["answer_tau"] == 2.5
    assert row["thinking_tokens_per_s"] == pytest.approx(10.0) and row["answer_tokens_per_s"] == pytest.approx(7.5)
    assert row["thinking_speedup"] == pytest.approx(1.0) and row["answer_speedup"] == pytest.approx(0.75)
    assert all(math.isnan(value) for value in thinking.record_columns(None, [9], mine, base).values())

    base_row = thinking.record_columns(MARKERS, [9], base, base)
    assert math.isnan(base_row["thinking_acceptance"]) and math.isnan(base_row["thinking_tau"])
    assert base_row["thinking_speedup"] == pytest.approx(1.0)
    # Two prompts: the sums' ratios, not the mean of each prompt's.
    other = thinking.record_columns(MARKERS, [9], Emitted([5, 2, 6], [(0, 0), (2, 2)], [0.1, 0.2, 0.2]), None)
    summary = thinking.summary_columns([row, other], [base_row, base_row])
    assert summary["thinking_tokens"] == 7 and summary["answer_tokens"] == 3
    assert summary["thinking_acceptance"] == pytest.approx(5 / 8)
    assert summary["thinking_tau"] == pytest.approx(1 + 5 / 4)  # both of its forwards began inside
    assert summary["thinking_tokens_per_s"] == pytest.approx(7 / 0.6)
    assert summary["thinking_speedup"] == pytest.approx((7 / 0.6) / (8 / 0.8))
    # A record that was not split (no markers, or a resumed run's older row) leaves the summary empty.
    unsplit = thinking.summary_columns([row, {}], [base_row, base_row])
    assert all(math.isnan(value) for value in unsplit.values())


def test_a_run_on_a_pair_that_thinks_splits_every_answer(thinking_pair, tmp_path):
    """End to end on a tiny pair whose vocabulary holds the markers and whose answers close their
    thinking part-way: each record's spans add up to its answer, as its own outputs label them."""
    target, draft, prompts = thinking_pair
    out = tmp_path / "run"
    args = ["--target", target, "--draft", draft, "--dataset", prompts, "--method", "speculative"]
    args += ["--k", "2,3", "--max-new-tokens", "40", "--warmup", "0"]
    result = cli("run", *args, "--out", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "thinking apart from answering" in result.stdout
    records = check_thinking_split(out, {("torch", "speculative")})
    assert (records["thinking_tokens"] > 0).all() and (records["answer_tokens"] > 0).any()
    drafting = records[records["method"] == "speculative"]
    assert (drafting["thinking_accepted"] > 0).any() and (drafting["answer_accepted"] > 0).any()
    summary = pd.read_csv(out / "summary.csv")
    for row in summary.to_dict("records"):
        rows = records[
            (records["method"] == row["method"])
            & (records["k"].fillna(-1) == (row["k"] if row["k"] == row["k"] else -1))
        ]
        for span in thinking.SPANS:
            assert row[f"{span}_tokens"] == rows[f"{span}_tokens"].sum()
            assert row[f"{span}_tokens_per_s"] == pytest.approx(rows[f"{span}_tokens"].sum() / rows[f"{span}_s"].sum())
            if row["method"] == "speculative":
                want = rows[f"{span}_accepted"].sum() / rows[f"{span}_drafted"].sum()
                assert row[f"{span}_acceptance"] == pytest.approx(want)

    # '' turns the split off; markers that are not one token of the target's vocabulary are refused.
    off = cli("run", *args, "--num-prompts", "1", "--k", "2", "--thinking-markers", "", "--out", tmp_path / "off")
    assert off.returncode == 0, off.stderr[-2000:]
    assert pd.read_csv(tmp_path / "off" / "records.csv")["thinking_tokens"].isna().all()
    refused = cli("run", *args, "--thinking-markers", "<think>,<reason>", "--out", tmp_path / "bad")
    one_line_error(refused, "--thinking-markers", "'<reason>'")
    assert not (tmp_path / "bad").exists()
