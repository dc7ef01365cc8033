"""Every engine specbench drives, side by side behind one small interface:

- loop.py: specbench's own process, one request at a time: specbench's loop, and transformers'
  generate and assisted generation (hf.py), timed phase by phase;
- vllm.py: vLLM in this process, N requests in flight;
- server.py: any running server over its OpenAI-compatible API (launch.py starts one on loopback).

The interface, which the benchmark (bench/run.py, bench/serve.py) and the audit drive:

- ``run(requests, concurrency, sampling, rate, indices)`` decodes every request, at most
  ``concurrency`` in flight, the requests arriving at ``rate`` per second (Poisson, seeded) or all at
  once, and yields each one's Served as it finishes. ``indices`` name the requests in the run (their
  prompt indices; default their positions): request i samples from a random stream of its own,
  seeded from (sampling.seed, indices[i]), so that N requests of one prompt are N independent
  samples and a request's sample does not depend on what else is sent with it;
- ``counters()`` reads the engine's own speculative-decoding counters (cumulative; a block's are the
  difference over it);
- it is a context manager: stopped (or disconnected) on exit.

A request is a prompt's token ids, or for a chat endpoint its messages. An engine is built from what
it needs (its models, its method and K, a URL), never from the run's configuration.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import queue
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from specbench.core.errors import SpecbenchError, first_line


def margin(top: list[float] | None) -> float | None:
    """How far apart, in log-probability, the two likeliest tokens at a position were (None: not given)."""
    if not top or len(top) < 2:
        return None
    first, second = sorted(top, reverse=True)[:2]
    return first - second


def request_seed(seed: int, index: int, salt: str = "") -> int:
    """The seed of request ``index``'s random stream: a stable hash of the run's seed, the index and
    ``salt`` (specbench's loop adds the method, so that adding or reordering methods changes no
    other method's samples), below 2**31, which every server's seed field takes."""
    digest = hashlib.blake2b(f"{seed}/{index}/{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


@dataclass
class Served:
    """One request as its client saw it; times are seconds from its block's start."""

    index: int
    tokens: list[int]
    start: float
    first: float  # when the first token arrived
    end: float
    histogram: list[int] | None  # verify steps that accepted 0, 1, ..., K drafts (None: not reported)
    drafted: int = 0
    rejected: int | None = None  # verify steps that rejected a drafted token (None: not reported)
    accepted: int | None = None  # accepted drafts, where the engine counts them without a histogram
    k: int | None = None  # the lookahead the engine says it drafted with
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks of the answer
    text: str = ""
    error: str = ""  # why the request failed ("" when it did not)
    reported: int | None = None  # the server's count of answer tokens, where it gave no ids
    encoded: bool = False  # tokens are the client's encoding of the text (the server gave no ids)
    measured: object = None  # specbench's loop: its loop.Measurement (the decode, its time and phases)
    logprobs: list[list[float]] | None = (
        None  # per position, the likeliest tokens' log-probabilities (Sampling.logprobs), likeliest first
    )
    top_ids: list[list[int]] | None = None  # their token ids, where the engine gives them (vLLM)
    # Each verify step's (drafted, accepted) in order, where the engine says (vLLM's detailed metrics).
    steps: list[tuple[int, int]] | None = None
    arrivals: list[float] | None = None  # when each of ``tokens`` came, where the chunks carried ids

    @property
    def reports_acceptance(self) -> bool:
        """Whether the response said what was drafted and accepted."""
        return self.histogram is not None or self.accepted is not None

    @property
    def count(self) -> int:
        """Answer tokens: the engine's ids, else the server's own count."""
        return len(self.tokens) if self.reported is None else self.reported

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, in ms."""
        return 1000 * (self.end - self.first) / (self.count - 1) if self.count > 1 else float("nan")


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """When each of ``count`` requests is sent, in seconds from the first: all at once for an infinite
    rate, else a Poisson process of ``rate`` requests per second (exponential gaps, seeded), as
    `vllm bench serve --request-rate` sends them."""
    if math.isinf(rate):
        return [0.0] * count
    draw = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += draw.expovariate(rate)
    return times


class LoopThread:
    """An asyncio event loop on a thread of its own, so an engine can drive many requests at once
    while the benchmark, which is synchronous, takes each result as it finishes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def wait(self, coroutine: Awaitable):
        """Run ``coroutine`` on the loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stream(self, count: int, drive: Callable[[queue.Queue], Awaitable[None]], what: str) -> Iterator:
        """Run ``drive(finished)`` on the loop and yield the ``count`` items it puts in ``finished``
        as they come; an exception it puts there stops the stream with one line naming ``what``."""
        finished: queue.Queue = queue.Queue()
        done = asyncio.run_coroutine_threadsafe(drive(finished), self.loop)
        for _ in range(count):
            item = finished.get()
            if isinstance(item, BaseException):
                raise SpecbenchError(f"{what} failed mid-run: {first_line(item)}") from None
            yield item
        done.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
