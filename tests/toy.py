"""A toy causal LM whose next-token logits are a fixed function of the last two tokens.

Its exact sequence distribution is enumerable, so tests can compare a decoder's samples with it:
chi_square_p does, for speculative decoding with any drafter.
"""

import itertools
from collections import Counter

import torch
from scipy.stats import chisquare

from specbench.decoding.decode import speculative_decode
from specbench.decoding.sampling import Sampling, adjust, context_mask, warp
from specbench.drafters.model import ModelDrafter

VOCAB, LENGTH, PROMPT = 3, 4, [0, 2]
SAMPLES = 6000
# Chi-square p-values below this fail; with a fixed seed the test is deterministic, and the
# negative controls of test_lossless show a broken verifier lands far under it.
P_FLOOR = 1e-3


class ToyLM:
    def __init__(self, vocab: int, seed: int, scale: float = 1.5):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randn(vocab + 1, vocab + 1, vocab, generator=g) * scale
        self.device = torch.device("cpu")
        self.seen: list[int] = []

    @property
    def table(self) -> torch.Tensor:
        return self._table

    @table.setter
    def table(self, table: torch.Tensor) -> None:
        # The rows as a nested list: the law tests read a row tens of thousands of times, and indexing
        # a tensor by two ints costs more than the rest of the toy's forward.
        self._table = table
        self._rows = [list(by_last) for by_last in table.unbind(0)]

    def logits_after(self, context: list[int]) -> torch.Tensor:
        prev2 = context[-2] if len(context) > 1 else self.vocab
        return self._rows[prev2][context[-1]]

    def reset(self) -> None:
        self.seen = []

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        self.reset()
        self.forward(prompt_ids)

    def forward(self, token_ids: torch.Tensor, last: int = 1, positions=None, mask=None) -> torch.Tensor:
        """``positions`` are ignored: the law depends only on the attended ids, in order."""
        ids = token_ids.tolist()
        start = len(self.seen)
        self.seen += ids
        rows, allowed = [], None if mask is None else mask.tolist()
        for i in range(max(0, len(ids) - last), len(ids)):
            if allowed is None:
                context = self.seen[max(0, start + i - 1) : start + i + 1]
            else:
                # Node i has read the cache and nodes 0..i; the mask's later columns are its later siblings.
                read = allowed[i][: start + i + 1]
                context = [s for s, ok in zip(self.seen[: start + i + 1], read, strict=True) if ok]
            rows.append(self.logits_after(context))
        return torch.stack(rows)

    @property
    def length(self) -> int:
        return len(self.seen)

    def keep(self, path, new: int) -> None:
        if new:
            tail = self.seen[-new:]
            self.seen[-new:] = [tail[i] for i in path]


def exact_distribution(model: ToyLM, prompt: list[int], length: int, cfg: Sampling) -> dict[tuple, float]:
    """Probability of every continuation of ``length`` tokens when sampling from ``model`` alone."""
    law = {}
    for seq in itertools.product(range(model.vocab), repeat=length):
        prob, context = 1.0, list(prompt)
        for t in seq:
            seen = context_mask(torch.tensor(context), model.vocab, cfg)  # the repetition penalty's context
            prob *= float(warp(adjust(model.logits_after(context), cfg, seen), cfg)[t])
            context.append(t)
        law[seq] = prob
    return law


def chi_square_p(
    target: ToyLM, draft, k: int, cfg: Sampling, seed: int = 0, schedule=None, negative_control: bool = False
) -> float:
    """p-value of the sequences sampled by speculative decoding against the target's exact law;
    ``draft`` is a drafter, or a model that drafts by sampling; ``schedule`` sets K round by round;
    ``negative_control``: the drafter or loop is broken on purpose (see drawn_p)."""
    generator = torch.Generator().manual_seed(seed)
    drafter = draft if hasattr(draft, "propose") else ModelDrafter(draft, cfg, generator)
    return speculative_law_p(target, drafter, k, cfg, generator, schedule, negative_control=negative_control)


def speculative_law_p(
    target, drafter, k: int, cfg: Sampling, generator, schedule=None, samples: int = SAMPLES, negative_control=False
) -> float:
    """p-value of ``samples`` speculative decodes of LENGTH tokens after PROMPT (on the target's
    device) against the target's exact law (``target.logits_after``); see drawn_p."""
    prompt = torch.tensor(PROMPT, device=target.device)

    def draw() -> tuple:
        return tuple(speculative_decode(target, drafter, prompt, k, LENGTH, cfg, generator, schedule=schedule).tokens)

    return drawn_p(exact_distribution(target, PROMPT, LENGTH, cfg), draw, samples, negative_control)


def law_p(target: ToyLM, cfg: Sampling, counts: Counter) -> float:
    """p-value of sampled sequence counts (any number) against the target's exact law of LENGTH tokens after PROMPT."""
    return counts_p(exact_distribution(target, PROMPT, LENGTH, cfg), counts)


def counts_p(law: dict[tuple, float], counts: Counter) -> float:
    """Pearson's chi-square p-value of sequence ``counts`` against ``law`` (sequence -> probability)."""
    assert set(counts) <= {s for s, p in law.items() if p > 0}, "sampled a sequence the target cannot produce"
    # Cells the warp made impossible carry no information; keep the rest.
    cells = [s for s, p in law.items() if p > 0]
    observed = [counts[s] for s in cells]
    mass = sum(law[s] for s in cells)
    expected = [law[s] / mass * sum(counts.values()) for s in cells]
    return chisquare(observed, expected).pvalue


def drawn_p(law: dict[tuple, float], draw, samples: int = SAMPLES, negative_control: bool = False) -> float:
    """p-value of ``samples`` sequences from ``draw()`` against ``law``.

    ``negative_control``: the draws come from a variant broken on purpose, which must score under
    P_FLOOR. It is scored after a quarter and a half of the draws too, and stops at the first score
    under P_FLOOR: most broken variants get there early, and a p-value that low says the test catches
    them. A subtle one still gets every draw, as the exactness test it controls does. No look is
    under a quarter, so that the chi-square approximation holds (few cells expect under 5)."""
    counts: Counter = Counter()
    for look in (samples // 4, samples // 2, samples) if negative_control else (samples,):
        while counts.total() < look:
            counts[draw()] += 1
        p = counts_p(law, counts)
        if p < P_FLOOR:
            break
    return p
