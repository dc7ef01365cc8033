"""Thinking apart from answering: a reasoning model's answer split at its thinking markers.

A reasoning model spends most of its tokens inside a thinking span (``<think>`` ... ``</think>``), and a
draft may predict that span better or worse than the answer after it. Every token of an answer is
labelled thinking or answering: from an open marker through its close marker (both included) it is
thinking, else answering; an answer whose prompt ends inside a span (a chat template that opens it)
starts thinking. Each target forward (the prefill's first token, then one verify step each) belongs
to the span of the first token it emitted, with its drafted and accepted counts; each token's time
is the time since the token before it arrived (the first's since the request began), so the spans'
seconds add up to the request's. Pure functions: the engines' records (results/) call them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from specbench.core.metrics import ratio

SPANS = ("thinking", "answer")


@dataclass(frozen=True)
class Markers:
    """The token ids that open and close a thinking span."""

    open: int
    close: int

    def starts_inside(self, prompt_ids: Sequence[int]) -> bool:
        """Whether an answer to ``prompt_ids`` begins inside a span: the prompt's last marker opens one."""
        for token in reversed(prompt_ids):
            if token in (self.open, self.close):
                return token == self.open
        return False

    def labels(self, tokens: Sequence[int], inside: bool = False) -> list[bool]:
        """Per token, whether it is thinking (markers included); ``inside``: the answer starts in a span."""
        thinking = []
        for token in tokens:
            if token == self.open:
                inside = True
            thinking.append(inside)
            if token == self.close:
                inside = False
        return thinking


@dataclass
class Span:
    """What one request spent in thinking, or in answering. The counts are NaN where the engine did
    not say how its forwards drafted, ``seconds`` where it did not say when each token came."""

    tokens: int = 0
    forwards: float = 0  # target forwards whose first emitted token lies in the span
    drafted: float = 0
    accepted: float = 0
    seconds: float = 0.0


def arrivals(steps: Sequence[tuple[int, int]], ends: Sequence[float], total: float, tokens: int) -> list[float] | None:
    """Per token, when it came (seconds from the request's start), for a decode whose forward ``s``
    emitted ``steps[s]``'s accepted count + 1 tokens and ended at ``ends[s]``. The last token comes at
    ``total``, so that the bookkeeping after the last forward is counted. None when the counts do not
    fit the forwards."""
    if len(ends) != len(steps) or not aligned(steps, tokens):
        return None
    times = [end for (_, accepted), end in zip(steps, ends, strict=True) for _ in range(accepted + 1)][:tokens]
    return times[:-1] + [total] if times else times


def aligned(steps: Sequence[tuple[int, int]], tokens: int) -> bool:
    """Whether forwards emitting accepted + 1 tokens each give ``tokens`` tokens, the last one cut
    short at most (a stop token, or the token limit, inside its accepted drafts)."""
    before = sum(accepted + 1 for _, accepted in steps[:-1])
    return bool(steps) and before < tokens <= before + steps[-1][1] + 1


def split(
    tokens: Sequence[int],
    thinking: Sequence[bool],
    steps: Sequence[tuple[int, int]] | None,
    times: Sequence[float] | None,
) -> dict[str, Span]:
    """The thinking and answering spans of one answer: ``thinking`` labels each token (Markers.labels);
    ``steps`` holds each target forward's (drafted, accepted) in order, the prefill's (0, 0) first
    (None, or counts that do not fit the tokens: the counts are NaN); ``times`` each token's arrival
    (None: the seconds are NaN)."""
    spans = {name: Span() for name in SPANS}
    for label in thinking:
        spans[SPANS[not label]].tokens += 1
    if steps is not None and aligned(steps, len(tokens)):
        position = 0
        for drafted, accepted in steps:
            span = spans[SPANS[not thinking[position]]]
            span.forwards += 1
            span.drafted += drafted
            span.accepted += accepted
            position += accepted + 1
    else:
        for span in spans.values():
            span.forwards = span.drafted = span.accepted = math.nan
    if times is None or len(times) != len(tokens):
        for span in spans.values():
            span.seconds = math.nan
    else:
        for label, before, now in zip(thinking, [0.0, *times], times, strict=False):
            spans[SPANS[not label]].seconds += now - before
    return spans


def _column(span: str, field: str) -> str:
    return f"{span}_{'s' if field == 'seconds' else field}"


RAW = tuple(_column(span, field.name) for span in SPANS for field in fields(Span))
# What random weights make meaningless, as they do the whole answer's acceptance and tau.
WEIGHT_DEPENDENT = tuple(f"{span}_{name}" for span in SPANS for name in ("acceptance", "tau"))
DERIVED = tuple(f"{span}_{name}" for span in SPANS for name in ("acceptance", "tau", "tokens_per_s", "speedup"))


def raw_columns(spans: Mapping[str, Span] | None) -> dict:
    """records.csv's counts of each span (NaN when the answer was not split: no markers)."""
    if spans is None:
        return dict.fromkeys(RAW, math.nan)
    return {_column(name, f.name): getattr(spans[name], f.name) for name in SPANS for f in fields(Span)}


def summed(rows: Sequence[Mapping]) -> dict[str, Span]:
    """The spans of ``rows`` (records with raw_columns) added up."""
    return {name: Span(*(sum(row[_column(name, f.name)] for row in rows) for f in fields(Span))) for name in SPANS}


def derived_columns(spans: Mapping[str, Span], base: Mapping[str, Span] | None) -> dict:
    """Each span's acceptance (accepted over drafted), tau (tokens per target forward: 1 + accepted
    over forwards), tokens/s, and speedup over ``base`` (the baseline's spans on the same prompts);
    NaN where a span is empty or a figure is unknown."""
    values = {}
    for name in SPANS:
        span, other = spans[name], base[name] if base is not None else None
        rate = ratio(span.tokens, span.seconds)
        base_rate = ratio(other.tokens, other.seconds) if other is not None else math.nan
        values[f"{name}_acceptance"] = ratio(span.accepted, span.drafted)
        values[f"{name}_tau"] = 1 + ratio(span.accepted, span.forwards) if span.drafted else math.nan
        values[f"{name}_tokens_per_s"] = rate
        values[f"{name}_speedup"] = ratio(rate, base_rate)
    return values


@dataclass(frozen=True)
class Emitted:
    """What an engine said of one answer: its tokens, each target forward's (drafted, accepted) with
    the prefill's (0, 0) first (None: not said), and each token's arrival (None: not said)."""

    tokens: Sequence[int]
    steps: Sequence[tuple[int, int]] | None = None
    times: Sequence[float] | None = None

    def spans(self, markers: Markers, prompt_ids: Sequence[int]) -> dict[str, Span]:
        return split(
            self.tokens, markers.labels(self.tokens, markers.starts_inside(prompt_ids)), self.steps, self.times
        )


def record_columns(
    markers: Markers | None, prompt_ids: Sequence[int], answer: Emitted, base: Emitted | None = None
) -> dict:
    """records.csv's span columns of one answer, its speedups over ``base`` (the baseline's answer to
    the same prompt; None: none to compare with). All NaN without markers."""
    if markers is None:
        return dict.fromkeys(RAW + DERIVED, math.nan)
    spans = answer.spans(markers, prompt_ids)
    return {**raw_columns(spans), **derived_columns(spans, base.spans(markers, prompt_ids) if base else None)}


def summary_columns(rows: Sequence[Mapping], base_rows: Sequence[Mapping]) -> dict:
    """summary.csv's span columns over a block's records ``rows``, speedups over ``base_rows`` (the
    baseline's on the same prompts); NaN when the answers were not split."""
    if not rows or not all(map(_was_split, rows)):
        return dict.fromkeys(("thinking_tokens", "answer_tokens", *DERIVED), math.nan)
    spans = summed(rows)
    base = summed(base_rows) if base_rows and all(map(_was_split, base_rows)) else None
    return {"thinking_tokens": spans["thinking"].tokens, "answer_tokens": spans["answer"].tokens,
            **derived_columns(spans, base)}  # fmt: skip


def _was_split(row: Mapping) -> bool:
    """Whether a record's answer was split (a resumed run's older records lack the columns)."""
    tokens = row.get("thinking_tokens", math.nan)
    return tokens is not None and not math.isnan(tokens)
