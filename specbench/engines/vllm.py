"""vLLM in this process as an engine (--engine vllm): one engine per method and K, N requests in flight.

The only module that imports vllm, and only when an engine starts, so the core install never needs
it. Like specbench's own loop, the engine sees token ids only: prompts go in as ids (the tokenizer is
not even loaded in vLLM) and outputs come back as ids. Requests are driven through vLLM's AsyncLLM
in this process, at most N at a time, as a server's clients would send them, and timed from the
client's side: submission, first token, last token.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specbench.core.errors import SpecbenchError
from specbench.engines import LoopThread, Served, arrivals, first_line, margin, request_seed

if TYPE_CHECKING:  # the command line checks --engine vllm's options with this module, before torch loads
    from specbench.decoding.sampling import Sampling

INSTALL = (
    "--engine vllm needs vLLM, which lives in an environment of its own: run `make install-vllm` "
    "(CPU; docs/engines.md has the CUDA command), then run .venv-vllm/bin/specbench"
)
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE when unset: enough for a small model's few requests


@dataclass(frozen=True)
class EngineSpec:
    """Everything one engine is started with: vLLM's keyword arguments, built without vLLM."""

    model: str  # a checkpoint directory, or an architecture's directory with dummy weights
    dtype: str
    seed: int
    max_model_len: int
    max_num_seqs: int
    speculative: dict | None = None  # vLLM's speculative_config; None for plain decoding
    dummy: bool = False  # --random-weights: vLLM's dummy weight loading
    parallel: dict = field(default_factory=dict)  # tensor/pipeline parallel sizes, executor backend
    extra: dict = field(default_factory=dict)  # --engine-args, applied last

    def kwargs(self) -> dict:
        return {
            "model": self.model,
            "skip_tokenizer_init": True,  # ids in, ids out
            "dtype": self.dtype,
            "seed": self.seed,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "load_format": "dummy" if self.dummy else "auto",
            "speculative_config": self.speculative,
            # A prompt decoded in the warm-up would otherwise be a cache hit when timed.
            "enable_prefix_caching": False,
            # Each request's acceptance histogram (vLLM refuses it without speculation).
            # "detailed" adds each step's drafted and accepted counts: a step that drafted fewer
            # than K tokens and had them all accepted is no rejection.
            **({"per_request_spec_decode_metrics": "detailed"} if self.speculative else {}),
            "disable_log_stats": False,
            **self.parallel,
            **self.extra,
        }


def vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):  # the CPU build is published under its own name
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return None


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class Engine:
    """A started vLLM engine, driven from an event loop on a thread of its own (LoopThread)."""

    def __init__(self, spec: EngineSpec):
        if not available():
            raise SpecbenchError(INSTALL)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        # vLLM logs every step of its start; VLLM_LOGGING_LEVEL=INFO brings that back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        self.driver = LoopThread()
        self.llm = None
        self.llm = self.driver.wait(self._start(spec))
        self.requests = 0
        self.detokenizes = not spec.kwargs()["skip_tokenizer_init"]

    async def _start(self, spec: EngineSpec):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**spec.kwargs()))
        except TypeError as e:  # an --engine-args key vLLM does not have
            raise SpecbenchError(f"vLLM refused its arguments ({e}): check --engine-args") from None
        except Exception as e:
            raise SpecbenchError(f"vLLM could not start the engine for {spec.model}: {first_line(e)}") from None

    async def _stop(self) -> None:
        # The output handler goes first: it would report the engine it waits on as dead.
        if (handler := getattr(self.llm, "output_handler", None)) is not None:
            handler.cancel()
        self.llm.shutdown()

    def run(
        self,
        requests: list[list[int]],
        concurrency: int,
        sampling: Sampling,
        rate: float = math.inf,
        indices: list[int] | None = None,
    ) -> Iterator[Served]:
        """Decode every request, at most ``concurrency`` in flight; yields each as it finishes."""
        if sampling.stop and not self.detokenizes:  # vLLM would ignore them without a word
            raise SpecbenchError("stop strings need vLLM's tokenizer: --engine-args '{\"skip_tokenizer_init\": false}'")
        tag, self.requests = self.requests, self.requests + len(requests)
        indices = list(range(len(requests))) if indices is None else list(indices)
        drive = lambda finished: self._drive(requests, concurrency, sampling, rate, tag, indices, finished)  # noqa: E731
        yield from self.driver.stream(len(requests), drive, "the vLLM engine")

    async def _drive(self, requests, concurrency, sampling: Sampling, rate, tag, indices, finished: queue.Queue):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        # A request with a seed of its own gets a generator of its own, which vLLM's CPU worker cannot
        # rewind when it discards a token sampled mid-prefill ("CPU Generator does not use offset":
        # the engine dies). On the CPU, requests sample from the engine's generator, seeded by
        # EngineSpec.seed: independent draws still, reproducible only as a whole block.
        seeded = not current_platform.is_cpu()

        def params(index: int) -> SamplingParams:
            return SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty,
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty,
                logit_bias=dict(sampling.logit_bias) or None,
                logprobs=sampling.logprobs or None,
                seed=request_seed(sampling.seed, indices[index]) if seeded else None,
                stop_token_ids=list(sampling.stop_ids),
                stop=list(sampling.stop) or None,
                detokenize=bool(sampling.stop),  # stop strings are matched in text; ids are all we read
                output_kind=RequestOutputKind.DELTA,
            )

        gate = asyncio.Semaphore(concurrency)
        began = time.perf_counter()

        async def one(index: int, ids: list[int], at: float) -> None:
            await asyncio.sleep(at)
            async with gate:
                start = time.perf_counter() - began
                tokens: list[int] = []
                first, last, itl, histogram, drafted, rejected, k = None, None, [], None, 0, None, None
                arrivals, steps = [], None
                logprobs, top_ids = ([], []) if sampling.logprobs else (None, None)
                request = TokensPrompt(prompt_token_ids=ids)
                async for out in self.llm.generate(request, params(index), f"{tag + index}"):
                    completion = out.outputs[0]
                    if completion.token_ids:
                        now = time.perf_counter() - began
                        first = now if first is None else first
                        if last is not None:
                            itl.append(now - last)
                        last = now
                        arrivals += [now] * len(completion.token_ids)
                    tokens += completion.token_ids
                    if logprobs is not None:
                        # Each position holds the top logprobs, and the sampled token's where it is
                        # not among them.
                        for pos in completion.logprobs or []:
                            ranked = sorted(pos.items(), key=lambda item: -item[1].logprob)
                            logprobs.append([lp.logprob for _, lp in ranked])
                            top_ids.append([token for token, _ in ranked])
                    if out.finished and (spec := completion.spec_decode_metrics) is not None:
                        histogram, drafted = list(spec.histogram), spec.num_draft_tokens
                        k = len(histogram) - 1
                        if spec.per_step_drafted:
                            steps = list(zip(spec.per_step_drafted, spec.per_step_accepted, strict=True))
                            rejected = sum(1 for proposed, accepted in steps if accepted < proposed)
                end = time.perf_counter() - began
            first = end if first is None else first
            served = Served(index, tokens, start, first, end, histogram, drafted, rejected, k=k, itl=itl)
            served.logprobs, served.top_ids = logprobs, top_ids
            served.steps, served.arrivals = steps, arrivals
            finished.put(served)

        async def guarded(index: int, ids: list[int], at: float) -> None:
            try:
                await one(index, ids, at)
            except BaseException as e:  # handed to the caller, who stops at it
                finished.put(e)

        times = arrivals(len(requests), rate, sampling.seed)
        await asyncio.gather(*(guarded(i, ids, at) for i, (ids, at) in enumerate(zip(requests, times, strict=True))))

    def margin_at(self, request: list[int], position: int) -> float | None:
        """How far apart, in log-probability, the two likeliest tokens were at ``position`` of the
        engine's greedy answer to ``request``, untimed."""
        from specbench.decoding.sampling import Sampling

        greedy = Sampling(max_new_tokens=position + 1, logprobs=2)
        served = next(self.run([request], 1, greedy))
        return margin(served.logprobs[position]) if served.logprobs and len(served.logprobs) > position else None

    def counters(self) -> dict[str, float | list[float]]:
        """vLLM's own speculative-decoding counters so far in this process (Prometheus), by name
        without the ``vllm:spec_decode_`` prefix: num_drafts, num_draft_tokens, num_accepted_tokens
        and the vector num_accepted_tokens_per_pos."""
        from vllm.v1.metrics.reader import Counter, Vector, get_metrics_snapshot

        found: dict[str, float | list[float]] = {}
        for metric in get_metrics_snapshot():
            name = metric.name.removeprefix("vllm:spec_decode_")
            if name == metric.name:
                continue
            if isinstance(metric, Counter):
                found[name] = found.get(name, 0) + metric.value
            elif isinstance(metric, Vector):
                before = found.get(name, [0] * len(metric.values))
                found[name] = [a + b for a, b in zip(before, metric.values, strict=True)]
        return found

    def close(self) -> None:
        if self.llm is not None:
            self.driver.wait(self._stop())
            self.llm = None
        self.driver.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_count(device: str) -> tuple[int, str]:
    """The devices vLLM can split a model over here: the GPUs, or on a CPU machine its cores."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU(s)"
    return len(os.sched_getaffinity(0)), "CPU cores"
