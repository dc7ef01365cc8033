"""transformers' own decoding as an engine's: ``generate``, plain or assisted by a draft model, timed
on specbench's phase clock like specbench's loop. The hf methods (methods/registry.py) decode through it, one
request at a time in the Loop engine (loop.py), so each is judged against transformers' own
baseline (hf-generate) on the same clock.
"""

from __future__ import annotations

import torch

from specbench.decoding.decode import SAMPLE_BATCH, DecodeResult
from specbench.decoding.timing import ForwardLaps


class _HookedLaps:
    """timing.ForwardLaps driven by a module's forward hooks, so transformers' generate is split into
    phases (and its forwards counted) like specbench's loop."""

    def __init__(self, module, clock, phase: str):
        self.laps = ForwardLaps(clock, phase)
        self._handles = [
            module.register_forward_pre_hook(lambda *_: self.laps.before()),
            module.register_forward_hook(lambda *_: self.laps.after()),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def generate_kwargs(target, settings, stop_ids: frozenset[int], width: int | None = None) -> dict:
    """``generate``'s arguments for ``settings`` (loop.Settings): the tokens to generate, the warp, the
    logit bias and the repetition penalty, the ids that stop an answer. ``width``: the logits specbench's
    loop scores (the pair's); the target's rows past it, embedding padding a narrower draft lacks, are
    suppressed as the loop leaves them out, so that generate's law is the baseline's (a random-weight
    target's padding rows are as likely as any other)."""
    sampling = settings.sampling
    kwargs = {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": not sampling.greedy,
        "eos_token_id": sorted(stop_ids) or None,
        "pad_token_id": getattr(target.tokenizer, "pad_token_id", None)
        if getattr(target.tokenizer, "pad_token_id", None) is not None
        else min(stop_ids, default=0),
    }
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        if sampling.eta > 0:
            kwargs["eta_cutoff"] = sampling.eta
        if sampling.min_p > 0:
            kwargs["min_p"] = sampling.min_p
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if sampling.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        kwargs["sequence_bias"] = {(token,): bias for token, bias in sampling.logit_bias}
    if width is not None and width < target.width:
        kwargs["suppress_tokens"] = list(range(width, target.width))
    return kwargs


def hf_samples(
    target,
    prompt_ids: torch.Tensor,
    settings,
    seed: int,
    stop_ids: frozenset[int],
    count: int,
    width: int | None = None,
) -> list:
    """``count`` independent answers of transformers' plain sampling to one prompt, drawn as rows of
    batches of at most SAMPLE_BATCH (generate's num_return_sequences): each answer cut after its first stop
    token. For the audit's reference arms, whose thousands of samples would take hours one by one.
    ``width``: as generate_kwargs'."""
    kwargs = generate_kwargs(target, settings, stop_ids, width)
    torch.manual_seed(seed)  # generate() samples from the global generator
    answers = []
    ids = prompt_ids.view(1, -1)
    while len(answers) < count:
        rows = min(SAMPLE_BATCH, count - len(answers))
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), num_return_sequences=rows, **kwargs)
        for row in out[:, prompt_ids.shape[0] :].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row))
            answers.append(row[:end])
    return answers


def hf_generate(
    target,
    prompt_ids: torch.Tensor,
    settings,
    seed: int,
    stop_ids: frozenset[int],
    assistant=None,
    k: int | None = None,
    clock=None,
    universal: bool = False,
    width: int | None = None,
):
    """transformers' own ``generate`` of ``target`` (a models.LoadedModel) with ``settings``
    (loop.Settings: the tokens to generate and the warp): plain, or assisted by ``assistant``
    (another) with exactly ``k`` draft tokens per round (constant schedule, confidence threshold
    off, so K means what it means in specbench's loop). Returns the engine's DecodeResult with
    forward counts; ``clock`` (a timing.PhaseClock) is lapped around every forward of both models.

    ``universal``: the assistant has a tokenizer of its own, and generate gets both tokenizers
    (transformers' universal assisted generation: its draft's text re-tokenized under greedy, the
    vocabularies' intersection under sampling). Its drafts are then counted in the assistant's tokens,
    which the target's accepted ones cannot be set against: the result counts none. ``width``: as
    generate_kwargs'.

    transformers' first target call also verifies the first drafts, so its prefill holds a round.
    """
    kwargs = generate_kwargs(target, settings, stop_ids, width)
    if assistant is not None:
        config = assistant.model.generation_config
        config.num_assistant_tokens = k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant.model
        if universal:
            kwargs.update(tokenizer=target.tokenizer, assistant_tokenizer=assistant.tokenizer)
    counters = [_HookedLaps(target.model, clock, "verify")]
    if assistant is not None:
        counters.append(_HookedLaps(assistant.model, clock, "draft"))
    torch.manual_seed(seed)  # generate() samples from the global generator
    try:
        ids = prompt_ids.view(1, -1)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    finally:
        for counter in counters:
            counter.remove()
    tokens = out[0, prompt_ids.shape[0] :].tolist()
    result = DecodeResult(tokens=tokens, target_forwards=counters[0].laps.count)
    if assistant is not None and universal:
        result.draft_forwards = counters[1].laps.count - 1
    elif assistant is not None:
        result.drafted = counters[1].laps.count  # every assistant call drafts one token, its first one too
        result.draft_forwards = counters[1].laps.count - 1  # after its prefill, as in specbench's loop
        result.accepted = len(tokens) - result.target_forwards  # each target pass adds accepted + 1
    return result
