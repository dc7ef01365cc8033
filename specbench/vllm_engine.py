"""vLLM as a second engine (--engine vllm): one engine per method and K, N requests in flight.

The only module that imports vllm, and only when an engine starts, so the core install never needs
it. Like specbench's own loop, the engine sees token ids only: prompts go in as ids (the tokenizer is
not even loaded in vLLM) and outputs come back as ids. Requests are driven through vLLM's AsyncLLM
in this process, at most N at a time, as a server's clients would send them, and timed from the
client's side: submission, first token, last token.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import SpecbenchError

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


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]


@dataclass
class Served:
    """One request as its client saw it; times are seconds from its block's start."""

    index: int
    tokens: list[int]
    start: float
    first: float  # when the first token arrived
    end: float
    histogram: list[int] | None  # verify steps that accepted 0, 1, ..., K drafts (None: no speculation)
    drafted: int = 0
    rejected: int | None = None  # verify steps that rejected a drafted token (None: not reported)

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, in ms."""
        return 1000 * (self.end - self.first) / (len(self.tokens) - 1) if len(self.tokens) > 1 else float("nan")


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
    """A started vLLM engine with its own event loop on a thread, so requests can be driven
    asynchronously while the caller iterates over them as they finish."""

    def __init__(self, spec: EngineSpec):
        if not available():
            raise SpecbenchError(INSTALL)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        # vLLM logs every step of its start; VLLM_LOGGING_LEVEL=INFO brings that back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.llm = None
        self.llm = self._wait(self._start(spec))
        self.requests = 0

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _start(self, spec: EngineSpec):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**spec.kwargs()))
        except TypeError as e:  # an --engine-args key vLLM does not have
            raise SpecbenchError(f"vLLM refused its arguments ({e}): check --engine-args") from None
        except Exception as e:
            raise SpecbenchError(f"vLLM could not start the engine for {spec.model}: {_first_line(e)}") from None

    async def _stop(self) -> None:
        # The output handler goes first: it would report the engine it waits on as dead.
        if (handler := getattr(self.llm, "output_handler", None)) is not None:
            handler.cancel()
        self.llm.shutdown()

    def run(self, requests: list[list[int]], concurrency: int, sampling: Sampling) -> Iterator[Served]:
        """Decode every request, at most ``concurrency`` in flight; yields each as it finishes."""
        finished: queue.Queue = queue.Queue()
        tag, self.requests = self.requests, self.requests + len(requests)
        done = asyncio.run_coroutine_threadsafe(self._drive(requests, concurrency, sampling, tag, finished), self.loop)
        for _ in requests:
            item = finished.get()
            if isinstance(item, BaseException):
                raise SpecbenchError(f"the vLLM engine failed mid-run: {_first_line(item)}") from None
            yield item
        done.result()

    async def _drive(self, requests, concurrency, sampling: Sampling, tag: int, finished: queue.Queue) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        gate = asyncio.Semaphore(concurrency)
        began = time.perf_counter()

        async def one(index: int, ids: list[int]) -> None:
            async with gate:
                start = time.perf_counter() - began
                tokens: list[int] = []
                first, histogram, drafted, rejected = None, None, 0, None
                async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"{tag + index}"):
                    completion = out.outputs[0]
                    if completion.token_ids and first is None:
                        first = time.perf_counter() - began
                    tokens += completion.token_ids
                    if out.finished and (spec := completion.spec_decode_metrics) is not None:
                        histogram, drafted = list(spec.histogram), spec.num_draft_tokens
                        if spec.per_step_drafted:
                            steps = zip(spec.per_step_accepted, spec.per_step_drafted, strict=True)
                            rejected = sum(1 for accepted, proposed in steps if accepted < proposed)
                end = time.perf_counter() - began
            first = end if first is None else first
            finished.put(Served(index, tokens, start, first, end, histogram, drafted, rejected))

        async def guarded(index: int, ids: list[int]) -> None:
            try:
                await one(index, ids)
            except BaseException as e:  # handed to the caller, who stops at it
                finished.put(e)

        await asyncio.gather(*(guarded(i, ids) for i, ids in enumerate(requests)))

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
            self._wait(self._stop())
            self.llm = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_line(e: BaseException) -> str:
    """The line of an exception that says what went wrong (pydantic's first line only counts errors)."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    said = next((line.removeprefix("Value error, ") for line in lines if line.startswith("Value error")), None)
    said = said or (lines[0] if lines else "")
    return f"{type(e).__name__}: {said.split(' [type=')[0]}" if said else type(e).__name__


def device_count(device: str) -> tuple[int, str]:
    """The devices vLLM can split a model over here: the GPUs, or on a CPU machine its cores."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU(s)"
    return len(os.sched_getaffinity(0)), "CPU cores"
