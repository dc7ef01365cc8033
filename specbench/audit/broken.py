"""Deliberately wrong speculative decoding: the audit's known-broken subjects.

Each is specbench's loop (the draft model drafts K tokens, the target verifies them) with one bug
that an engine has shipped, reproduced on purpose. They exist to prove that `specbench audit` can
see such bugs: each must be flagged at the audit's default sample size, while the correct method
passes. They are not decoding methods (`specbench run` does not know them); `specbench audit
--broken NAME` adds one as a subject.

The bugs, and where each was seen:

- draft-argmax: drafts greedily but hands the verifier its sampled distribution as q (transformers'
  assisted generation, issue 32867);
- q-temperature-1: drafts from the request's warp but judges with q at temperature 1, untruncated
  (verification with default sampling parameters instead of the request's; vLLM, PR 10198);
- q-untruncated: drafts from the top-k / top-p truncated q but judges with the untruncated one;
- draft-bf16: samples its drafts from logits rounded to bfloat16 and judges them in float32
  (DeepSpec, issue 31);
- greedy-verify: verifies greedily whatever the temperature (SGLang's EAGLE on one platform, PR 31214);
- penalty-ignored: the speculative path ignores the repetition penalty the request asks for
  (TensorRT-LLM's one-model speculation, PR 17701);
- accept-miscount: on a rejection, counts the rejected draft as accepted and continues after it
  (transformers' assisted generation, PR 28508).
"""

from __future__ import annotations

from dataclasses import replace

from specbench.methods.registry import Speculative


class Broken(Speculative):
    """specbench's loop with one bug: in how its drafter draws (``drafter_class``, a ModelDrafter of
    audit/bugs.py) or in how the target verifies (``verification``, a function of audit/bugs.py),
    each named, so that the subjects are declared without torch (`specbench list` shows them)."""

    drafter_class = ""  # "": a correct ModelDrafter
    verification = ""  # "": decode.verify
    counterpart = ""
    where = ""  # the engine and issue that shipped the bug

    @property
    def rule(self):
        from specbench.audit import bugs

        return getattr(bugs, self.verification) if self.verification else None

    def drafter(self, pair, settings, decoder, generator):
        from specbench.audit import bugs
        from specbench.drafters.model import ModelDrafter

        kind = getattr(bugs, self.drafter_class) if self.drafter_class else ModelDrafter
        return kind(pair.draft_lm, settings.sampling, generator, decoder.p_min(settings))


def broken(name: str, help: str, where: str, **what) -> Broken:
    """A Broken subject called ``name``."""
    kind = type(name, (Broken,), {"name": name, "help": help, "where": where, **what})
    return kind()


class PenaltyIgnored(Broken):
    def decode(self, pair, settings, decoder, ids, generator, on_round=None):
        blind = replace(settings.sampling, repetition_penalty=1.0)
        return super().decode(pair, replace(settings, sampling=blind), decoder, ids, generator, on_round)


BROKEN: dict[str, Broken] = {
    b.name: b
    for b in (
        broken(
            "draft-argmax",
            "drafts greedily, verified against the draft's sampled distribution",
            "transformers #32867",
            drafter_class="ArgmaxDrafter",
        ),
        broken(
            "q-temperature-1",
            "drafts from the request's warp, judged with q at temperature 1",
            "vLLM #10198",
            drafter_class="TemperatureOneDrafter",
        ),
        broken(
            "q-untruncated",
            "drafts from the top-k/top-p truncated q, judged with the untruncated q",
            "truncation applied to the draft's samples only",
            drafter_class="UntruncatedDrafter",
        ),
        broken(
            "draft-bf16",
            "drafts sampled from bfloat16 logits, judged in float32",
            "DeepSpec #31",
            drafter_class="Bfloat16Drafter",
        ),
        broken(
            "greedy-verify",
            "verifies greedily at every temperature",
            "SGLang #31214",
            verification="greedy_verify",
        ),
        broken(
            "accept-miscount",
            "a rejected draft is counted as accepted",
            "transformers #28508",
            verification="miscounted_verify",
        ),
        type(
            "PenaltyIgnoredSubject",
            (PenaltyIgnored,),
            {
                "name": "penalty-ignored",
                "help": "the repetition penalty is ignored on the speculative path",
                "where": "TensorRT-LLM #17701",
            },
        )(),
    )
}
