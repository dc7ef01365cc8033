"""Decoding methods as registered objects.

A method (method.Method) says whether it takes a lookahead K, whether it needs the draft model, the
options it owns, what its cost ratio c is, and how it decodes one prompt. Nothing outside this module
names a method of specbench's loop (the serving engines' methods are in methods/served.py): adding one is a
class here and an entry in METHODS.

A method decodes with ``settings`` (engines/loop.Settings): the tokens to generate, the sampling,
and its own options by name. ``cfg``, where a method checks or describes the run's options, is the
run's configuration (config.BenchConfig, which is built from these methods' options, so this module
cannot import it); ``costs`` its forward costs (costs.ForwardCosts).
"""

from __future__ import annotations

import math
import re

from specbench.core.errors import SpecbenchError
from specbench.core.options import COMPARE_PANEL, FIXED, K_POLICIES, SINKS, Option, names_given
from specbench.methods.base import Decoder, Level, Method, SpeculativeLoop

# The methods are declared without torch (see methods/base.py): each imports what it decodes with
# where it decodes.


class Baseline(Method):
    name, help, takes_k = "baseline", "the target alone, one token per forward with a KV cache (always runs)", False
    adjusts_logits = True

    def decode(self, pair, settings, decoder, ids, generator):
        from specbench.decoding.decode import autoregressive_decode

        return autoregressive_decode(
            pair.target_lm, ids, settings.max_new_tokens, settings.sampling, generator, pair.stop_ids
        )

    def decode_many(self, pair, settings, ids, count, seed):
        """``count`` untimed samples of one prompt, drawn in batches (the audit's reference arms)."""
        import torch

        from specbench.decoding.decode import autoregressive_samples

        generator = torch.Generator(pair.device).manual_seed(seed)
        return autoregressive_samples(
            pair.target.model, ids, count, settings.max_new_tokens, settings.sampling, generator, pair.stop_ids
        )


class Speculative(SpeculativeLoop):
    name, help, needs_draft = (
        "speculative",
        "specbench's loop: the draft model samples K tokens, one target forward verifies them",
        True,
    )
    counterpart = "draft"
    k_policies = K_POLICIES  # a ModelDrafter given decoder.p_min: it can stop where unsure
    adjusts_logits = True  # a chain of its own model's rows

    def c(self, costs):
        return costs.c

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.model import ModelDrafter

        return ModelDrafter(pair.draft_lm, settings.sampling, generator, decoder.p_min(settings))


class AcrossVocabularies(SpeculativeLoop):
    """A method of specbench's loop for a draft with its own tokenizer (drafters/vocab.py): the run's
    models/vocab.Bridge is its state, from which ``reach`` says what share of the baseline's tokens it
    can propose."""

    needs_draft, crosses_vocabularies = True, True
    reach = ""  # the Bridge's measure of what it can propose: share or spellable

    def c(self, costs):
        return costs.c

    def begin_run(self, pair, settings, decoder):
        decoder.state = pair.bridge

    def proposable(self, decoder, tokens):
        return getattr(decoder.state, self.reach)(tokens)


class SpeculativeIntersection(AcrossVocabularies):
    name, help = (
        "speculative-intersection",
        "for a draft with its own tokenizer: the draft samples K tokens among those whose text both vocabularies "
        "hold (token-level intersection, its rows renormalised there), one target forward verifies them",
    )
    reach = "share"
    counterpart = "draft"  # vLLM's draft model over a draft with its own vocabulary is this algorithm
    k_policies = K_POLICIES  # a ModelDrafter given decoder.p_min: it can stop where unsure
    adjusts_logits = True  # a chain of its own rows, in the target's ids

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.model import ModelDrafter
        from specbench.models.vocab import VocabView

        view = VocabView(pair.draft_lm, pair.bridge, pair.target_lm.width, pair.clock)
        return ModelDrafter(view, settings.sampling, generator, decoder.p_min(settings))


class SpeculativeText(AcrossVocabularies):
    name, help = (
        "speculative-text",
        "for a draft with its own tokenizer: the draft writes K tokens, their text is tokenized for the target and "
        "verified as fixed candidates (exact at any temperature, as prompt lookup)",
    )
    reach = "spellable"
    adjusts_logits = True  # its candidates have no q; the target's rows are adjusted in verify

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.vocab import TextDrafter

        return TextDrafter(pair.draft_lm, pair.bridge, settings.sampling, generator, pair.clock)


KV_BUDGET = Option(
    "kv_budget",
    1024,
    "self-sparse, triforce: KV-cache positions the target drafts over (the first 16, then per --kv-policy).",
    low=2 * SINKS,
    problem=f"--kv-budget must be at least {2 * SINKS} (the first {SINKS} tokens are always kept)",
)
KV_POLICY = Option(
    "kv_policy",
    "retrieval",
    "self-sparse, triforce: retrieval (chunks of 8 tokens that the last prompt token's query scores highest, "
    "per layer and head: TriForce's retrieval cache) or window (the most recent tokens: StreamingLLM).",
    choices=("retrieval", "window"),
)
DRAFT_WINDOW = Option(
    "draft_window",
    256,
    "triforce, speculative-window: the draft model's streaming window (sinks + recent tokens).",
    low=2 * SINKS + 2,
)


def timed_draft(lm, pair, settings, decoder: Decoder, generator):
    """A ModelDrafter of ``lm`` (a method's own drafting model) whose forwards are laps of the draft phase."""
    from specbench.decoding.timing import TimedLM
    from specbench.drafters.model import ModelDrafter

    return ModelDrafter(TimedLM(lm, pair.clock, "draft"), settings.sampling, generator, decoder.p_min(settings))


def draft_window(pair, settings):
    """The draft model over a streaming window of --draft-window positions (speculative-window, triforce):
    a models.lm.WindowLM."""
    from specbench.models.lm import WindowLM

    lm = pair.draft_lm
    return WindowLM(lm.model, lm.width, pair.draft.head_tokens, settings.draft_window, lm.fast)


def sparse_view(pair, settings):
    """The target over --kv-budget positions of its cache (self-sparse, triforce): a models.lm.SparseView."""
    from specbench.models.lm import SparseView

    return SparseView(pair.target_lm, settings.kv_budget, settings.kv_policy)


SELF_SPARSE_LEVEL = Level("self-sparse", sparse_view)
DRAFT_WINDOW_LEVEL = Level("draft-window", draft_window)


class SpeculativeWindow(SpeculativeLoop):
    name, help, needs_draft = (
        "speculative-window",
        "speculative with the draft model over a streaming window of its cache (--draft-window: the first tokens and "
        "the newest, at positions within the window): a draft trained on short sequences stays within them at "
        "long contexts; the full target verifies",
        True,
    )
    draft_level = "draft model over its window"
    levels = (DRAFT_WINDOW_LEVEL,)
    options = (DRAFT_WINDOW,)
    k_policies = K_POLICIES  # a ModelDrafter given decoder.p_min: it can stop where unsure

    def c(self, costs):
        return costs.level_c(DRAFT_WINDOW_LEVEL.name)

    def begin_run(self, pair, settings, decoder):
        decoder.state = draft_window(pair, settings)

    def drafter(self, pair, settings, decoder, generator):
        return timed_draft(decoder.state, pair, settings, decoder, generator)


class PromptLookup(SpeculativeLoop):
    name, help = (
        "prompt-lookup",
        "K tokens copied from the latest match of the last n-gram in prompt and output; no draft model",
    )
    counterpart = "ngram"
    adjusts_logits = True  # its candidates have no q; the target's rows are adjusted in verify

    def c(self, costs):
        return 0.0  # no draft model runs; its lookups are host-side bookkeeping

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.lookup import PromptLookupDrafter

        return PromptLookupDrafter()


# Prompt lookup's rounds beside a drafting model (lookup-or-draft, lookup-or-eagle).
LOOKUP_K = Option(
    "lookup_k",
    6,
    "lookup-or-draft, lookup-or-eagle: the most tokens a round drafted by lookup proposes (a copy costs no "
    "forward, so it may run longer than K).",
    low=1,
    problem="--lookup-k must be at least 1",
)
LOOKUP_NGRAM = Option(
    "lookup_ngram",
    2,
    "lookup-or-draft, lookup-or-eagle: lookup drafts a round when the sequence's last N or more tokens occurred "
    "before (it matches the longest n-gram up to max(N, 3)); 1 also copies after a single repeated token.",
    low=1,
    problem="--lookup-ngram must be at least 1",
)


def lookup_first(drafter, settings):
    """Prompt lookup where the sequence repeats, ``drafter`` elsewhere (drafters.chained)."""
    from specbench.drafters.chained import FirstThatDrafts
    from specbench.drafters.lookup import PromptLookupDrafter

    return FirstThatDrafts([PromptLookupDrafter(shortest=settings.lookup_ngram, lookahead=settings.lookup_k), drafter])


class LookupOrDraft(SpeculativeLoop):
    name, help, needs_draft = (
        "lookup-or-draft",
        "prompt lookup where the sequence repeats (its last --lookup-ngram or more tokens occurred before: up to "
        "--lookup-k tokens that followed), the draft model's K tokens elsewhere; the target verifies either",
        True,
    )
    inner_level, inner_beside = "prompt lookup", True  # beside the draft model: the target checks its rounds
    chains = False  # a lookup round drafts up to --lookup-k tokens for free: the chain formulas do not apply
    k_policies = K_POLICIES  # its model rounds are a ModelDrafter's, given decoder.p_min
    adjusts_logits = True  # the model's rows are adjusted in drafting, lookup's candidates in verify
    options = (LOOKUP_K, LOOKUP_NGRAM)

    def longest_draft(self, cfg, k: int) -> int:
        return max(k, cfg.lookup_k)

    def c(self, costs):
        return costs.c  # one draft-model forward; lookup's rounds run none

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.model import ModelDrafter

        return lookup_first(
            ModelDrafter(pair.draft_lm, settings.sampling, generator, decoder.p_min(settings)), settings
        )


class Cascade(SpeculativeLoop):
    name, help, needs_draft = (
        "cascade",
        "the draft model sped up by prompt lookup beneath it: lookup proposes, the draft checks the proposal in "
        "one forward by exact speculative sampling, and its rows are the q of the target's verification; "
        "--cascade-split M leaves the positions after the first M to lookup alone",
        True,
    )
    inner_level = "prompt lookup"
    options = (
        Option(
            "cascade_split",
            0,
            "cascade: the draft model (sped up by lookup) drafts the first M positions of a round (M at most K) and "
            "prompt lookup alone the rest (a horizontal cascade); 0: the draft model drafts all K.",
            low=0,
            problem="--cascade-split must be >= 0 (0: the draft model drafts all K positions)",
        ),
    )

    def check_options(self, cfg):
        if cfg.cascade_split > min(cfg.ks):  # else a row would name a split that never applied
            raise SpecbenchError(
                f"--cascade-split {cfg.cascade_split} is more than --k {min(cfg.ks)}: the draft model drafts the first "
                "M of a round's K positions and lookup the rest, so M must be at most K (every K of a sweep): lower it "
                "(0: the draft model drafts all K)"
            )

    def c(self, costs):
        return costs.c  # one of its draft-model forwards; it needs fewer of them than K per round

    def drafter(self, pair, settings, decoder, generator):
        from specbench.decoding.timing import TimedDrafter
        from specbench.drafters.cascade import CascadeDrafter
        from specbench.drafters.lookup import PromptLookupDrafter

        lookup = TimedDrafter(PromptLookupDrafter(), pair.clock, "inner")
        return CascadeDrafter(pair.draft_lm, settings.sampling, generator, settings.cascade_split or None, lower=lookup)


TREES = Option(
    "trees",
    ["2,2"],
    "Tree shape for --method tree and lookup-tree: the branching at each depth, e.g. 2,2,1 "
    "(2 + 4 + 4 = 10 nodes, K = 3). Repeat to compare shapes.",
    flags=("--tree",),
    repeat=lambda given: [tree.replace(" ", "") for tree in given],
    check=lambda trees: all(re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", tree) for tree in trees),
    problem="--tree: give the branching at each depth, like 2,2,1",
    recorded=False,  # the tree column holds the shape
)


class Tree(SpeculativeLoop):
    name, help, takes_k, takes_tree, needs_draft = (
        "tree",
        "the draft model expands a token tree of the --tree shape (top-b children under greedy, b draws from q "
        "under sampling); one target forward verifies the whole tree",
        False,
        True,
        True,
    )
    options = (TREES,)
    k_policies = (FIXED,)  # its shape is its lookahead

    def c(self, costs):
        return costs.c

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.trees import TreeDrafter

        return TreeDrafter(pair.draft_lm, settings.sampling, generator, decoder.tree)


class LookupTree(SpeculativeLoop):
    name, help, takes_k, takes_tree = (
        "lookup-tree",
        "prompt lookup with every earlier continuation of the last n-gram, merged into a trie of at most the "
        "--tree shape's nodes and depth; no draft model",
        False,
        True,
    )
    options = (TREES,)
    k_policies = (FIXED,)  # its shape is its lookahead

    def c(self, costs):
        return 0.0

    def drafter(self, pair, settings, decoder, generator):
        from specbench.drafters.propose import tree_parents
        from specbench.drafters.trees import LookupTreeDrafter

        return LookupTreeDrafter(nodes=len(tree_parents(decoder.tree)), depth=len(decoder.tree))


class Online(Speculative):
    name, help, learns = (
        "online",
        "speculative with a draft that learns as the run goes: every --online-every prompts it is trained on the "
        "target's rows where the target rejected it (kept from verification); weights change between prompts only",
        True,
    )
    options = (
        Option("online_every", 1, "online: update the draft after every N prompts.", low=1),
        # One small step per update: on 160 prose prompts (a simulation of greedy rounds, K=2 and 4) 1 step
        # at 1e-4 raised alpha as much as 2-4 steps or 3e-5..2e-4 did, for a third of the training time;
        # 4 steps at 3e-4 first lowered it, and 1e-3 halved it.
        Option(
            "online_steps",
            1,
            "online: optimiser steps per update, over the lessons since the last one.",
            low=1,
        ),
        Option(
            "online_lr",
            1e-4,
            "online: learning rate of the draft's updates (AdamW).",
            check=lambda lr: lr > 0,
            problem="--online-lr must be positive",
        ),
        Option(
            "save_draft",
            None,
            "online: write the updated draft here at the end (a checkpoint --draft loads; one k<K>/ directory per K, "
            "k<K>-<policy>/ beside a fixed K's, when several rows learn). The shipped draft is never changed.",
            recorded=False,
        ),
    )

    def begin_run(self, pair, settings, decoder):
        from specbench.methods.online import OnlineConfig, OnlineLearner

        online = OnlineConfig(settings.online_every, settings.online_steps, settings.online_lr)
        decoder.state = OnlineLearner(
            pair.draft, pair.draft_lm.width, online, pair.device, pair.draft_lm.fast is not None
        )

    def drafter(self, pair, settings, decoder, generator):
        return timed_draft(decoder.state.lm, pair, settings, decoder, generator)

    def decode(self, pair, settings, decoder, ids, generator):
        from specbench.methods.online import Lessons, rejection

        lessons = []

        def keep(round_, at):
            if (lesson := rejection(round_, at)) is not None:
                lessons.append(lesson)

        result = super().decode(pair, settings, decoder, ids, generator, on_round=keep)
        return Lessons.of(result, lessons)

    def after_prompt(self, decoder, ids, result):
        return decoder.state.learn(ids, result)

    def save(self, decoder, out):
        decoder.state.save(out)


class SelfSparse(SpeculativeLoop):
    name, help = (
        "self-sparse",
        "the target drafts for itself over --kv-budget tokens of its KV cache (the first ones and the chunks its last "
        "query scores highest, or with --kv-policy window the most recent); the full target verifies",
    )

    levels = (SELF_SPARSE_LEVEL,)
    draft_level = "target over its KV budget"
    options = (KV_BUDGET, KV_POLICY)
    k_policies = K_POLICIES  # a ModelDrafter given decoder.p_min: it can stop where unsure

    def c(self, costs):
        return costs.level_c(SELF_SPARSE_LEVEL.name)

    def begin_run(self, pair, settings, decoder):
        decoder.state = sparse_view(pair, settings)

    def drafter(self, pair, settings, decoder, generator):
        decoder.state.watch()  # before the target's prefill, which comes next
        return timed_draft(decoder.state, pair, settings, decoder, generator)


class TriForce(SpeculativeLoop):
    name, help, needs_draft = (
        "triforce",
        "two levels of speculation (TriForce): the draft model over a streaming window of its cache (--draft-window) "
        "proposes --inner-k tokens at a time to the target over --kv-budget tokens of its cache (as self-sparse), "
        "which checks them exactly; the full target verifies what that level drafted, its rows as q",
        True,
    )
    draft_level = "target over its KV budget"
    inner_level = "draft model over its window"
    levels = (SELF_SPARSE_LEVEL, DRAFT_WINDOW_LEVEL)
    options = (
        KV_BUDGET,
        KV_POLICY,
        DRAFT_WINDOW,
        Option("inner_k", 2, "triforce: draft-model tokens the middle level checks at a time.", low=1),
    )

    def c(self, costs):
        return costs.level_c(SELF_SPARSE_LEVEL.name)  # a drafting step of the level the target verifies

    def begin_run(self, pair, settings, decoder):
        decoder.state = sparse_view(pair, settings), draft_window(pair, settings)

    def drafter(self, pair, settings, decoder, generator):
        from specbench.decoding.timing import TimedLM
        from specbench.drafters.cascade import CascadeDrafter
        from specbench.drafters.model import ModelDrafter

        view, window = decoder.state
        view.watch()
        lower = ModelDrafter(TimedLM(window, pair.clock, "inner"), settings.sampling, generator)
        middle = TimedLM(view, pair.clock, "draft")
        return CascadeDrafter(middle, settings.sampling, generator, lower=lower, inner_k=settings.inner_k)


def _seed(generator) -> int:
    """transformers' generate samples from the global generator: seed it from this method's stream."""
    import torch

    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


SPECULATOR = Option(
    "speculator",
    None,
    "An EAGLE-3 head's checkpoint directory (the format vLLM and SGLang load, or vLLM's speculators layout; "
    "`specbench distill --kind eagle` trains one), its hub id (as --target's: the local cache, else downloaded "
    "once) or a shipped head's alias: the head of --method eagle, eagle-tree, eagle-dynamic and "
    "lookup-or-eagle, and of vLLM's eagle3 / eagle1. Default: the target's own head where specbench ships one "
    "(smollm2-135m-eagle).",
)


def head_lm(pair, settings):
    """The EAGLE head as a drafting model (models.eagle_head.HeadLM)."""
    from specbench.models.eagle_head import HeadLM

    return HeadLM(pair.head)


EAGLE_LEVEL = Level("eagle", head_lm)


class Eagle(SpeculativeLoop):
    name, help = (
        "eagle",
        "EAGLE: a one-layer head (--speculator) drafts K tokens from the target's own features (EAGLE-3: three of its "
        "layers, fused) and scores them with its own head over a reduced vocabulary; one target forward verifies them",
    )
    needs_speculator = True
    counterpart = "eagle3"
    draft_level = "EAGLE head"
    levels = (EAGLE_LEVEL,)
    options = (SPECULATOR,)
    k_policies = K_POLICIES  # its chain stops where the head is unsure, given decoder.p_min

    def c(self, costs):
        return costs.level_c(EAGLE_LEVEL.name)

    def shape(self, settings, decoder: Decoder) -> dict:
        """How its drafter drafts: a chain (here, stopping where unsure under the confidence policy),
        a fixed tree or a dynamic one."""
        return {"p_min": decoder.p_min(settings)}

    def drafter(self, pair, settings, decoder, generator):
        from specbench.decoding.timing import TimedDrafter
        from specbench.drafters.eagle import EagleDrafter

        drafter = EagleDrafter(
            pair.head,
            pair.target_lm,
            pair.target_lm.width,
            settings.sampling,
            generator,
            **self.shape(settings, decoder),
        )
        return TimedDrafter(drafter, pair.clock, "draft")

    def decode(self, pair, settings, decoder, ids, generator, on_round=None):
        pair.target_lm.record_features(pair.head.config.taps)
        try:
            return super().decode(pair, settings, decoder, ids, generator, on_round)
        finally:
            pair.target_lm.record_features(None)


class EagleTree(Eagle):
    name, help, takes_k, takes_tree = (
        "eagle-tree",
        "EAGLE's head drafts a token tree of the --tree shape (top-b children under greedy, b draws from q under "
        "sampling), one head forward per level; one target forward verifies the tree",
        False,
        True,
    )
    counterpart = ""
    options = (SPECULATOR, TREES)
    k_policies = (FIXED,)  # its shape is its lookahead

    def shape(self, settings, decoder):
        return {"shape": decoder.tree}


class EagleDynamic(Eagle):
    name, help = (
        "eagle-dynamic",
        "EAGLE-2's dynamic tree: K levels deep, the --dynamic-width most probable nodes of each level offer their "
        "--dynamic-width most probable children, and the --dynamic-nodes most probable of all make the tree",
    )
    counterpart, shapes_tree = "", True
    k_policies = (FIXED,)  # K is its depth; a round drafts a fixed number of nodes
    options = (
        SPECULATOR,
        Option(
            "dynamic_nodes", 5, "eagle-dynamic, lookup-or-eagle: draft tokens the target verifies per round.", low=1
        ),
        Option(
            "dynamic_width",
            2,
            "eagle-dynamic, lookup-or-eagle: nodes expanded per level, and children offered by each.",
            low=1,
        ),
    )

    def shape(self, settings, decoder):
        return {"dynamic": (settings.dynamic_nodes, settings.dynamic_width)}

    def longest_draft(self, cfg, k: int) -> int:
        # A round verifies --dynamic-nodes tokens, and the head's cache holds the --dynamic-width nodes it read
        # at each of the K - 1 levels above the last: either may be more than K.
        return max(k, cfg.dynamic_nodes, cfg.dynamic_width * (k - 1))


class LookupOrEagle(EagleDynamic):
    name, help = (
        "lookup-or-eagle",
        "prompt lookup where the sequence repeats (as lookup-or-draft: up to --lookup-k tokens that followed its last "
        "--lookup-ngram or more), EAGLE-2's dynamic tree from the head elsewhere (as eagle-dynamic); the target "
        "verifies either",
    )
    inner_level, inner_beside = "prompt lookup", True  # beside the head: the target checks its rounds
    options = (*EagleDynamic.options, LOOKUP_K, LOOKUP_NGRAM)

    def longest_draft(self, cfg, k: int) -> int:
        return max(super().longest_draft(cfg, k), cfg.lookup_k)

    def drafter(self, pair, settings, decoder, generator):
        return lookup_first(super().drafter(pair, settings, decoder, generator), settings)


# generate runs the eager forward (full head): hf-assisted's c is timed on it, not on the fast path.
def eager(which: str):
    """A Level's build: the eager forward of the pair's ``which`` model ("target" or "draft")."""

    def build(pair, settings):
        from specbench.models.lm import HFCausalLM

        return HFCausalLM(getattr(pair, which).model, pair.width)

    return build


EAGER_TARGET = Level("eager-target", eager("target"))
EAGER_DRAFT = Level("eager-draft", eager("draft"))


class HFAssisted(Method):
    name, help, needs_draft = (
        "hf-assisted",
        "transformers' generate(assistant_model=draft) with exactly K draft tokens per round",
        True,
    )
    engine, adjusts_logits, levels = "hf", True, (EAGER_TARGET, EAGER_DRAFT)
    reference = "hf-generate"  # transformers' own plain decoding, which runs whenever this does
    prefill_verifies = True  # the assistant drafts first; the target's first call reads the prompt and them

    def check(self, pair):
        if pair.target.width != pair.draft.width:
            raise SpecbenchError(
                f"--method hf-assisted needs equal logit widths (target {pair.target.width}, draft {pair.draft.width}); "
                "transformers would switch to a different (universal) algorithm: drop hf-assisted for this pair"
            )

    def c(self, costs):
        return costs.level_c(EAGER_DRAFT.name) / costs.level_c(EAGER_TARGET.name)

    def verify_ratio(self, costs, drafts):
        return math.nan  # transformers' forward verifies, whose wider forwards are not timed: not specbench's

    def decode(self, pair, settings, decoder, ids, generator):
        from specbench.engines.hf import hf_generate

        seed = _seed(generator)
        return hf_generate(
            pair.target, ids, settings, seed, pair.stop_ids, pair.draft, decoder.k, pair.clock, width=pair.width
        )


class HFUniversal(HFAssisted):
    name, help = (
        "hf-universal",
        "transformers' universal assisted generation, for a draft with its own tokenizer (greedy only; transformers 5.23 on): generate(assistant_model="
        "draft, tokenizer, assistant_tokenizer) with K draft tokens per round",
    )
    crosses_vocabularies = True
    # The eager levels' costs are timed on the target's ids, which the draft cannot read: c is that of the
    # loop's own forwards, the draft's measured through the vocabularies' bridge (costs.draft_reading_target_ids).
    levels = ()

    def check(self, pair):
        pass  # the widths differ with the vocabularies

    def check_options(self, cfg):
        if problem := universal_problem(cfg.temperature == 0):
            raise SpecbenchError(problem)

    def c(self, costs):
        return costs.c

    def decode(self, pair, settings, decoder, ids, generator):
        from specbench.engines.hf import hf_generate

        # The audit's sampled settings reach here without check_options.
        if problem := universal_problem(settings.sampling.greedy):
            raise SpecbenchError(problem)
        seed = _seed(generator)
        return hf_generate(
            pair.target, ids, settings, seed, pair.stop_ids, pair.draft, decoder.k, pair.clock, universal=True
        )


# The transformers release hf-universal was measured on. On 5.0, pyproject's lowest, greedy generate with an
# assistant of another tokenizer fails inside transformers' Llama attention (a mask of the wrong length).
UNIVERSAL_FROM = (5, 23)


def universal_problem(greedy: bool) -> str | None:
    """Why hf-universal cannot run with the installed transformers, or under sampling; None when it can."""
    from importlib.metadata import version

    installed = version("transformers")
    if tuple(int(part) for part in installed.split(".")[:2]) < UNIVERSAL_FROM:
        return (
            f"--method hf-universal needs transformers {'.'.join(map(str, UNIVERSAL_FROM))} or later (installed: "
            f"{installed}, whose universal assisted generation fails): upgrade transformers, or drop hf-universal"
        )
    if not greedy:
        return (
            f"--method hf-universal decodes greedily only: under sampling transformers {installed}'s universal "
            "assisted generation stops with \"'AssistantToTargetTranslator' object has no attribute "
            "'assistant_overlap_token_ids'\" (measured 2026-11-28): use --temperature 0, or speculative-intersection"
        )
    return None


class HFGenerate(Method):
    name, help, takes_k = "hf-generate", "transformers' plain generate (checks that the baseline is as fast)", False
    engine, adjusts_logits = "hf", True

    def decode(self, pair, settings, decoder, ids, generator):
        from specbench.engines.hf import hf_generate

        return hf_generate(
            pair.target, ids, settings, _seed(generator), pair.stop_ids, clock=pair.clock, width=pair.width
        )

    def decode_many(self, pair, settings, ids, count, seed):
        """``count`` untimed samples of one prompt, in batches (the audit's reference arms)."""
        from specbench.engines.hf import hf_samples

        return hf_samples(pair.target, ids, settings, seed, pair.stop_ids, count, pair.width)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Baseline(),
        Speculative(),
        SpeculativeIntersection(),
        SpeculativeText(),
        SpeculativeWindow(),
        PromptLookup(),
        LookupOrDraft(),
        Cascade(),
        Tree(),
        LookupTree(),
        Online(),
        SelfSparse(),
        TriForce(),
        Eagle(),
        EagleTree(),
        EagleDynamic(),
        LookupOrEagle(),
        HFAssisted(),
        HFUniversal(),
        HFGenerate(),
    )
}


def check_vocabularies(method: Method, pair) -> None:
    """Raise SpecbenchError when ``method`` cannot draft with ``pair``'s draft because of its tokenizer:
    only the methods that cross vocabularies take a draft with its own, and they need one."""
    if not method.needs_draft or pair.draft is None or method.crosses_vocabularies is None:  # None: takes either
        return
    crossing = " and ".join(m.name for m in METHODS.values() if m.crosses_vocabularies)
    if pair.bridge is not None and not method.crosses_vocabularies:
        raise SpecbenchError(
            f"the tokenizers of {pair.target.name} and {pair.draft.name} differ: --method {method.name} needs a draft "
            f"with the target's tokenizer; {crossing} draft across vocabularies"
        )
    if pair.bridge is None and method.crosses_vocabularies:
        raise SpecbenchError(
            f"{pair.draft.name} shares {pair.target.name}'s tokenizer: --method {method.name} is for a draft with a "
            "tokenizer of its own; --method speculative runs this pair"
        )


BASELINE = METHODS["baseline"]
DEFAULT = [Speculative.name]  # what `specbench run` measures when no --method is given
# What sweep-context runs by default: the one-level draft model, and the methods built for long contexts.
LONG_CONTEXT = [Speculative.name, SpeculativeWindow.name, SelfSparse.name, TriForce.name]
METHOD = Option(
    "methods",
    DEFAULT,
    "Decoding methods, repeatable or comma-separated (`specbench list` describes each).",
    flags=("--method",),
    repeat=names_given,
    panel=COMPARE_PANEL,
)
