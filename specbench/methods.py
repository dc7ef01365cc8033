"""Decoding methods as registered objects.

A method says whether it takes a lookahead K, whether it needs the draft model, what its cost
ratio c is, and how it decodes one prompt. Nothing outside this module names a method: adding
one is a class here and an entry in METHODS.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .engine import (
    CascadeDrafter,
    DecodeResult,
    Drafter,
    LookupTreeDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    TreeDrafter,
    autoregressive_decode,
    speculative_decode,
    tree_parents,
)
from .errors import SpecbenchError
from .models import hf_generate
from .sampling import SamplingConfig
from .timing import PhaseClock

if TYPE_CHECKING:
    from .bench import ForwardCosts, Pair


class Method:
    name = ""
    help = ""
    takes_k = True  # decodes with a lookahead K (one row per K)
    takes_tree = False  # drafts a tree of the --tree shape (one row per shape; K is its depth)
    needs_draft = False  # the --draft model must be loaded

    @property
    def drafts(self) -> bool:
        return self.takes_k or self.takes_tree

    def check(self, pair: Pair) -> None:
        """Raise SpecbenchError when this method cannot run on ``pair``."""

    def c(self, costs: ForwardCosts) -> float:
        """Cost of one drafting step in one-token target forwards (NaN: the method does not draft)."""
        return math.nan

    def decode(
        self,
        pair: Pair,
        ids: torch.Tensor,
        k: int | None,
        sampling: SamplingConfig,
        max_new_tokens: int,
        generator: torch.Generator,
        clock: PhaseClock,
        tree: tuple[int, ...] | None = None,
    ) -> DecodeResult:
        """Decode one prompt, lapping ``clock`` around every model forward (see timing.py); ``tree``
        is the shape for methods that take one."""
        raise NotImplementedError


class Baseline(Method):
    name, help, takes_k = "baseline", "the target alone, one token per forward with a KV cache (always runs)", False

    def decode(self, pair, ids, k, sampling, max_new_tokens, generator, clock, tree=None):
        return autoregressive_decode(
            pair.timed(clock).target_lm, ids, max_new_tokens, sampling, generator, pair.stop_ids
        )


class SpeculativeLoop(Method):
    """A method that runs specbench's own speculative loop with its own drafter."""

    def drafter(
        self, pair: Pair, sampling: SamplingConfig, generator: torch.Generator, tree: tuple[int, ...] | None
    ) -> Drafter:
        raise NotImplementedError

    def decode(self, pair, ids, k, sampling, max_new_tokens, generator, clock, tree=None):
        timed = pair.timed(clock)
        drafter = self.drafter(timed, sampling, generator, tree)
        return speculative_decode(timed.target_lm, drafter, ids, k, max_new_tokens, sampling, generator, pair.stop_ids)


class Speculative(SpeculativeLoop):
    name, help, needs_draft = (
        "speculative",
        "specbench's loop: the draft model samples K tokens, one target forward verifies them",
        True,
    )

    def c(self, costs):
        return costs.c

    def drafter(self, pair, sampling, generator, tree):
        return ModelDrafter(pair.draft_lm, sampling, generator)


class PromptLookup(SpeculativeLoop):
    name, help = (
        "prompt-lookup",
        "K tokens copied from the latest match of the last n-gram in prompt and output; no draft model",
    )

    def c(self, costs):
        return 0.0  # no draft model runs; its lookups are host-side bookkeeping

    def drafter(self, pair, sampling, generator, tree):
        return PromptLookupDrafter()


class Cascade(SpeculativeLoop):
    name, help, needs_draft = (
        "cascade",
        "the draft model sped up by prompt lookup beneath it: lookup proposes, the draft checks the proposal in "
        "one forward by exact speculative sampling, and its rows are the q of the target's verification",
        True,
    )

    def c(self, costs):
        return costs.c  # one of its draft-model forwards; it needs fewer of them than K per round

    def drafter(self, pair, sampling, generator, tree):
        return CascadeDrafter(pair.draft_lm, sampling, generator)


class Tree(SpeculativeLoop):
    name, help, takes_k, takes_tree, needs_draft = (
        "tree",
        "the draft model expands a token tree of the --tree shape (top-b children under greedy, b draws from q "
        "under sampling); one target forward verifies the whole tree",
        False,
        True,
        True,
    )

    def c(self, costs):
        return costs.c

    def drafter(self, pair, sampling, generator, tree):
        return TreeDrafter(pair.draft_lm, sampling, generator, tree)


class LookupTree(SpeculativeLoop):
    name, help, takes_k, takes_tree = (
        "lookup-tree",
        "prompt lookup with every earlier continuation of the last n-gram, merged into a trie of at most the "
        "--tree shape's nodes and depth; no draft model",
        False,
        True,
    )

    def c(self, costs):
        return 0.0

    def drafter(self, pair, sampling, generator, tree):
        return LookupTreeDrafter(nodes=len(tree_parents(tree)), depth=len(tree))


def _seed(generator: torch.Generator) -> int:
    """transformers' generate samples from the global generator: seed it from this method's stream."""
    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


class HFAssisted(Method):
    name, help, needs_draft = (
        "hf-assisted",
        "transformers' generate(assistant_model=draft) with exactly K draft tokens per round",
        True,
    )

    def check(self, pair):
        if pair.target.width != pair.draft.width:
            raise SpecbenchError(
                f"--method hf-assisted needs equal logit widths (target {pair.target.width}, draft {pair.draft.width}); "
                "transformers would switch to a different (universal) algorithm: drop hf-assisted for this pair"
            )

    def c(self, costs):
        return costs.c

    def decode(self, pair, ids, k, sampling, max_new_tokens, generator, clock, tree=None):
        seed = _seed(generator)
        return hf_generate(pair.target, ids, max_new_tokens, sampling, seed, pair.stop_ids, pair.draft, k, clock)


class HFGenerate(Method):
    name, help, takes_k = "hf-generate", "transformers' plain generate (checks that the baseline is as fast)", False

    def decode(self, pair, ids, k, sampling, max_new_tokens, generator, clock, tree=None):
        return hf_generate(pair.target, ids, max_new_tokens, sampling, _seed(generator), pair.stop_ids, clock=clock)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (Baseline(), Speculative(), PromptLookup(), Cascade(), Tree(), LookupTree(), HFAssisted(), HFGenerate())
}
BASELINE = METHODS["baseline"]
DEFAULT = [Speculative.name]  # what `specbench run` measures when no --method is given
