"""What a decoding method is: the Method base class, the Decoder (a method with its K, tree shape
and lookahead policy), SpeculativeLoop (the base of every method that runs specbench's own loop)
and the drafting Levels the cost measurement times. The methods themselves are in methods/registry.py.

A method decodes with ``settings`` (engines/loop.Settings: the tokens to generate, the sampling and
its own options); ``cfg``, where a method checks the run's options or describes them, is the run's
configuration (config.BenchConfig); ``costs`` its forward costs (costs.ForwardCosts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specbench.core.options import CONFIDENCE, FIXED, HEURISTIC, Option

# This module and the methods' declarations import no torch: the command line reads them to parse and
# check a run's options in well under a second. What decodes is imported where it runs.
if TYPE_CHECKING:
    import torch

    from specbench.decoding.decode import DecodeResult, Drafter
    from specbench.engines.loop import Settings
    from specbench.methods.online import Learned
    from specbench.models.lm import HFCausalLM
    from specbench.models.pair import Pair


def method_label(method: str, k: int | None, shape: str, k_policy: str) -> str:
    """A decoder in one label, as progress, tables and verdicts name it: the method with its K or its
    tree shape, and its lookahead policy when K is not fixed."""
    label = f"{method} tree={shape}" if shape else f"{method} K={k}" if k else method
    return label if k_policy in ("", FIXED) else f"{label} {k_policy}"


@dataclass(eq=False)
class Decoder:
    """One way of decoding a prompt: a method with its lookahead K (a tree's depth), tree shape and
    lookahead policy, and what the method keeps between the prompts of a run (``state``: online's
    learner)."""

    method: Method
    k: int | None = None
    tree: tuple[int, ...] | None = None
    k_policy: str = FIXED
    state: object = None

    @property
    def shape(self) -> str:
        """The tree shape as the --tree option and the ``tree`` column write it ("" for a chain)."""
        return ",".join(map(str, self.tree)) if self.tree else ""

    @property
    def policy(self) -> str:
        """The ``k_policy`` column: how K is chosen each round ("" for a method without K)."""
        return self.k_policy if self.method.drafts else ""

    @property
    def label(self) -> str:
        return method_label(self.method.name, self.k, self.shape, self.k_policy)

    def options_column(self, cfg) -> str:
        """The ``options`` column: the method's own settings, and the confidence policy's threshold."""
        policy = f"draft_p_min={cfg.draft_p_min}" if self.k_policy == CONFIDENCE else ""
        return ",".join(part for part in (self.method.options_column(cfg), policy) if part)

    @property
    def schedule(self) -> Callable[[int, int, int], int] | None:
        """What sets K round by round (decode.speculative_decode's ``schedule``): None keeps it."""
        from specbench.decoding.decode import heuristic_k

        return heuristic_k if self.k_policy == HEURISTIC else None

    def p_min(self, settings: Settings) -> float | None:
        """Where a ModelDrafter stops a round (--draft-p-min) under the confidence policy; None: it drafts K."""
        return settings.draft_p_min if self.k_policy == CONFIDENCE else None


class Method:
    name = ""
    help = ""
    takes_k = True  # decodes with a lookahead K (one row per K)
    takes_tree = False  # drafts a tree of the --tree shape (one row per shape; K is its depth)
    shapes_tree = False  # takes K, but drafts a tree of a shape of its own each round (K is its depth)
    needs_draft = False  # the --draft model must be loaded
    needs_speculator = False  # the --speculator head must be given
    # Whether it drafts with a draft whose tokenizer is not the target's (drafters/vocab.py); None: with either.
    crosses_vocabularies: bool | None = False
    learns = False  # changes between prompts (begin_run, after_prompt and save say how)
    draft_level = "draft model"  # what drafts the tokens the target verifies
    inner_level = ""  # what proposes beneath the drafting model, in a method of several levels
    inner_beside = False  # the inner level drafts whole rounds for the target, beside the drafting model
    levels: tuple[Level, ...] = ()  # drafting models whose one-token forward the cost measurement times
    options: tuple[Option, ...] = ()  # the run options it owns (a flag each, a configuration field each)
    k_policies: tuple[str, ...] = (FIXED,)  # how it can choose K round by round (--k-policy; one row each)
    # Whether it honours a repetition penalty and a logit bias: every row it samples or verifies goes
    # through sampling.adjust at its own context (vLLM, transformers and servers apply their own).
    adjusts_logits = False
    engine = "torch"  # whose implementation decodes: specbench's loop, transformers' (hf) or vLLM's
    counterpart = ""  # the vLLM method that does the same, run in its place under --engine vllm
    reference = ""  # the method its speedup is over when not specbench's baseline (its engine's own)
    # Whether a decode's first target forward verifies drafts besides reading the prompt (transformers'
    # assisted generation drafts before it); specbench's loop drafts only after its prefill.
    prefill_verifies = False

    @property
    def drafts(self) -> bool:
        return self.takes_k or self.takes_tree

    @property
    def chains(self) -> bool:
        """Whether it drafts chains of K tokens, which the chain formulas (predicted_speedup) describe."""
        return self.takes_k and not self.shapes_tree

    def verify_forwards(self, target_forwards: int, decodes: int) -> int:
        """Of ``target_forwards`` over ``decodes`` decodes, the forwards that verified drafts: all but
        each decode's prefill, unless its prefill verifies too (prefill_verifies)."""
        return target_forwards if self.prefill_verifies else target_forwards - decodes

    def longest_draft(self, cfg, k: int) -> int:
        """The most tokens one of its rounds drafts at lookahead ``k`` (the caches make room for them)."""
        return k

    def check(self, pair: Pair) -> None:
        """Raise SpecbenchError when this method cannot run on ``pair``."""

    def check_options(self, cfg) -> None:
        """Raise SpecbenchError when the run's options do not fit this method (before any model loads)."""

    def options_column(self, cfg) -> str:
        """Its own options' values, for the ``options`` column."""
        return ",".join(f"{o.name}={getattr(cfg, o.name)}" for o in self.options if o.recorded)

    def c(self, costs) -> float:
        """Cost of one drafting step in one-token target forwards (NaN: the method does not draft)."""
        return math.nan

    def verify_ratio(self, costs, drafts: int) -> float:
        """Cost of verifying ``drafts`` tokens (a forward of drafts + 1) in one-token target forwards: the
        target forward verify_cost.csv times, specbench's loop's."""
        return costs.verify_ratio(drafts)

    def proposable(self, decoder: Decoder, tokens: list[int]) -> float:
        """The share of ``tokens`` (the baseline's output) this method can propose, for a draft with its
        own tokenizer (NaN: every other method)."""
        return math.nan

    def begin_run(self, pair: Pair, settings: Settings, decoder: Decoder) -> None:
        """Set up ``decoder.state`` before the first prompt (methods that learn, or keep a view of the cache)."""

    def decode(
        self, pair: Pair, settings: Settings, decoder: Decoder, ids: torch.Tensor, generator: torch.Generator
    ) -> DecodeResult:
        """Decode one prompt; ``pair`` is timed (pair.clock is lapped around every model forward)."""
        raise NotImplementedError

    def after_prompt(self, decoder: Decoder, ids: torch.Tensor, result: DecodeResult) -> Learned | None:
        """Work between prompts, after a prompt's timed decodes (methods that learn)."""
        return None

    def save(self, decoder: Decoder, out: Path) -> None:
        """Write what the method learned (--save-draft)."""


class SpeculativeLoop(Method):
    """A method that runs specbench's own speculative loop with its own drafter. The loop can set K
    round by round (heuristic) whatever the drafter; a method whose drafter is a ModelDrafter given
    the decoder's p_min opts in to the confidence policy too (k_policies = K_POLICIES)."""

    k_policies = (FIXED, HEURISTIC)
    rule = None  # the verification: None is decode.verify (the audit's broken subjects have their own)

    def drafter(self, pair: Pair, settings: Settings, decoder: Decoder, generator: torch.Generator) -> Drafter:
        raise NotImplementedError

    def decode(self, pair, settings, decoder, ids, generator, on_round=None):
        from specbench.decoding.decode import speculative_decode, verify

        drafter = self.drafter(pair, settings, decoder, generator)
        return speculative_decode(
            pair.target_lm,
            drafter,
            ids,
            decoder.k,
            settings.max_new_tokens,
            settings.sampling,
            generator,
            pair.stop_ids,
            on_round,
            decoder.schedule,
            self.rule or verify,
        )


@dataclass(frozen=True)
class Level:
    """A drafting model other than the draft model, built the way its method builds it, so the cost
    measurement times the forward the method runs; ``name`` is its verify_cost.csv row. ``build``
    takes the pair and the method's Settings."""

    name: str
    build: Callable[[Pair, Settings], HFCausalLM]
