"""The bugs of the audit's known-broken subjects (audit/broken.py), as code: drafters that draw wrongly
and verifications that judge wrongly. A subject names its bug here; this module is imported only when
a subject decodes."""

from __future__ import annotations

from dataclasses import replace

import torch

from specbench.decoding.decode import verify
from specbench.decoding.sampling import Sampling, Verdict, argmax, sample, warp
from specbench.drafters.model import ModelDrafter


class ArgmaxDrafter(ModelDrafter):
    def draw(self, logits, q):
        return argmax(q), q


class TemperatureOneDrafter(ModelDrafter):
    def draw(self, logits, q):
        return sample(q, self.generator), warp(logits, Sampling(temperature=1.0))


class UntruncatedDrafter(ModelDrafter):
    def draw(self, logits, q):
        return sample(q, self.generator), warp(logits, Sampling(temperature=self.sampling.temperature))


class Bfloat16Drafter(ModelDrafter):
    def draw(self, logits, q):
        return sample(warp(logits.to(torch.bfloat16).float(), self.sampling), self.generator), q


def greedy_verify(draft, target_logits, sampling: Sampling, generator, seen=None):
    """verify(), as if the temperature were 0."""
    verdict, _ = verify(draft, target_logits, replace(sampling, temperature=0.0), generator, seen)
    return verdict, None


def miscounted_verify(draft, target_logits, sampling: Sampling, generator, seen=None):
    """verify(), but a rejected draft is counted as accepted: it stays, and the next token comes from
    the target's row after it (the bonus row when it was the last)."""
    verdict, p = verify(draft, target_logits, sampling, generator, seen)
    n = verdict.accepted
    if n == len(draft.tokens):
        return verdict, p
    row = target_logits[n + 1] if sampling.greedy else p[n + 1]
    following = argmax(row) if sampling.greedy else sample(row, generator)
    return Verdict([*verdict.path, n], following, verdict.beta_sum, verdict.tested), p
