"""specbench's own process as an engine: one request at a time, timed phase by phase.

Every method whose engine is specbench's loop (torch) or transformers' generate (hf, hf.py) decodes
here: a Loop is one decoder (a method with its K, tree shape and lookahead policy) over the loaded
pair. The method decodes with what it is given here (method.Settings: the tokens to generate, the
sampling and its own options), never with the run's configuration.

A request is decoded ``repeats`` times, each from the same random stream (so identical work), and
the median run is kept, phases and all. Its wall time is the phase clock's span, from the
synchronised start to the last lap, so the phases add up to it exactly: nothing done outside the
clock (creating the generator, a garbage collection there) is counted in the time but in no phase.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specbench.core.errors import SpecbenchError
from specbench.decoding.decode import DecodeResult
from specbench.decoding.sampling import Sampling
from specbench.decoding.timing import PeakMemory, PhaseClock, Phases, synchronize
from specbench.decoding.transfer import ids_to_device
from specbench.engines import Served, margin, request_seed


@dataclass
class Measurement:
    """One prompt decoded by one method: the median run of the repeats and its phases."""

    result: DecodeResult
    seconds: float
    phases: Phases
    peak_memory: int | None = None  # bytes, the most any repeat held (timing.PeakMemory); None where unknown
    forward_ends: list[float] | None = None  # seconds from the start to each target forward's end (PhaseClock)


@dataclass(frozen=True)
class Settings:
    """What a method decodes with: the tokens to generate, the sampling, and its own options by name
    (only those it declares, and --draft-p-min, where the confidence policy stops a round).
    ``settings.kv_budget`` reads an option; one the method did not declare is an AttributeError."""

    max_new_tokens: int
    sampling: Sampling
    options: Mapping[str, object] = field(default_factory=dict)

    def __getattr__(self, name: str):
        if name != "options" and name in self.options:
            return self.options[name]
        raise AttributeError(f"{name} is not an option of this method")


def kept_models(decoder) -> list:
    """The models a method keeps in its decoder's state from one prompt to the next (a window draft, a
    sparse view of the target, TriForce's both, an online learner's draft): each holds the cache of
    its last decode until its next prefill."""
    state = decoder.state
    parts = state if isinstance(state, tuple) else (state, getattr(state, "lm", None))
    return [part for part in parts if hasattr(part, "prefill") and hasattr(part, "reset")]


def generator_for(device: torch.device, seed: int, prompt_index: int, method: str) -> torch.Generator:
    """An independent, reproducible random stream per (seed, prompt, method): adding, removing or
    reordering methods changes no other method's samples."""
    return torch.Generator(device=device).manual_seed(request_seed(seed, prompt_index, method))


class Loop:
    """``decoder`` over ``pair`` (a pair.Pair, loaded), its method given ``options`` (its own, by name)."""

    def __init__(self, pair, decoder, options: Mapping[str, object] | None = None, repeats: int = 1):
        self.pair, self.decoder, self.options, self.repeats = pair, decoder, dict(options or {}), repeats
        self.clock, self.memory = PhaseClock(pair.device), PeakMemory(pair.device)
        self.timed = pair.timed(self.clock)

    def settings(self, sampling: Sampling) -> Settings:
        return Settings(sampling.max_new_tokens, sampling, self.options)

    def run(
        self,
        requests: Sequence,
        concurrency: int,
        sampling: Sampling,
        rate: float = math.inf,
        indices: Sequence[int] | None = None,
    ) -> Iterator[Served]:
        """Decode every request (token ids) in turn; each Served carries its Measurement. Times are
        seconds from the first request's start, with no gaps: the decodes' own wall times.

        A method with ``decode_many`` (the baseline's sampling, and transformers') takes ``concurrency``
        > 1 for requests of one prompt: untimed samples in batches, each a random draw of its own."""
        if sampling.stop:
            raise SpecbenchError("specbench's loop stops on token ids, not on stop strings")
        settings, now = self.settings(sampling), 0.0
        if concurrency > 1 and hasattr(self.decoder.method, "decode_many") and math.isinf(rate):
            yield from self.batched(requests, settings, sampling.seed, indices)
            return
        if concurrency != 1 or not math.isinf(rate):
            raise SpecbenchError("specbench's loop decodes one request at a time: --concurrency 1, no --request-rate")
        for n, ids in enumerate(requests):
            ids = torch.as_tensor(ids, device=self.pair.device)
            measured = self.decode(ids, indices[n] if indices is not None else n, settings, sampling.seed)
            tokens, start = measured.result.tokens, now
            now += measured.seconds
            first = start + measured.phases.prefill
            yield Served(n, tokens, start, first, now, None, text="", measured=measured)

    def batched(self, requests: Sequence, settings: Settings, seed: int, indices) -> Iterator[Served]:
        first = torch.as_tensor(requests[0], device=self.pair.device)
        if any(not torch.equal(torch.as_tensor(r, device=self.pair.device), first) for r in requests[1:]):
            raise SpecbenchError("specbench's loop samples in batches only many requests of one prompt")
        salt = request_seed(seed, indices[0] if indices is not None else 0, self.decoder.method.name)
        answers = self.decoder.method.decode_many(self.pair, settings, first, len(requests), salt)
        for n, tokens in enumerate(answers):
            yield Served(n, tokens, 0.0, 0.0, 0.0, None)

    def decode(self, ids: torch.Tensor, index: int, settings: Settings, seed: int) -> Measurement:
        """Time one prompt's decode ``repeats`` times and keep the median run, phases and all, with
        the most memory any repeat held (measured outside the clock)."""
        method, runs, peaks = self.decoder.method, [], []
        for _ in range(self.repeats):
            generator = generator_for(self.pair.device, seed, index, method.name)
            # The caches of the decode before (another method's: the baseline never reads the draft's)
            # go before the peak is counted from here, or it holds them too.
            for lm in (self.pair.target_lm, self.pair.draft_lm):
                if lm is not None:
                    lm.reset()
            self.memory.reset()
            synchronize(self.pair.device)
            self.clock.start()
            result = method.decode(self.timed, settings, self.decoder, ids, generator)
            phases = self.clock.stop(result.past_stop)  # waits for the device
            runs.append((result, phases, self.clock.forward_ends))
            peaks.append(self.memory.peak())
            for lm in kept_models(self.decoder):  # or their caches would count in the next method's peak
                lm.reset()
        result, phases, ends = sorted(runs, key=lambda run: run[1].total)[(len(runs) - 1) // 2]
        return Measurement(result, phases.total, phases, None if None in peaks else max(peaks), ends)

    def margin_at(self, request, position: int) -> float | None:
        """How far apart, in log-probability, the target's two likeliest tokens were at ``position`` of
        its greedy answer to ``request`` (token ids), untimed."""
        return margin(self.top_two(request, position)[:2])

    @torch.inference_mode()
    def top_two(self, request, position: int, answer: Sequence[int] | None = None) -> tuple[float, float, float]:
        """The target's two largest logits at ``position`` of a greedy answer to ``request`` (token ids),
        untimed, and the rounding step of the logits' dtype at the larger one (bfloat16: 0.125 from 16
        to 32). The answer is the target's own (its argmax, one token per forward, as the baseline
        decodes), or ``answer``'s tokens where given (another engine's reference, read the same way)."""
        lm = self.pair.target_lm
        lm.reset()
        logits = lm.forward(torch.as_tensor(request, device=self.pair.device), last=1)[-1]
        given = None if answer is None else ids_to_device(list(answer[:position]), self.pair.device)  # one copy
        for n in range(position):
            token = logits.argmax().view(1) if given is None else given[n : n + 1]
            logits = lm.forward(token, last=1)[-1]
        first, second = logits.float().topk(2).values.tolist()
        return first, second, torch.finfo(logits.dtype).eps * 2.0 ** (math.frexp(first)[1] - 1)

    def counters(self) -> dict:
        """None of its own: a Measurement's DecodeResult counts what was drafted and accepted."""
        return {}

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc) -> None:
        pass
