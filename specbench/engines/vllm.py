"""vLLM in this process as an engine (--engine vllm): one engine per method and K, N requests in flight.

The only module that imports vllm, and only when an engine starts, so the core install never needs
it. Like specbench's own loop, the engine sees token ids only: prompts go in as ids (the tokenizer is
not even loaded in vLLM) and outputs come back as ids. Requests are driven through vLLM's AsyncLLM
in this process, at most N at a time, as a server's clients would send them, and timed from the
client's side: submission, first token, last token.

vLLM's own output (its log, and whatever the processes it starts print: the engine core, a worker
per device) goes to a log file in the run's folder (LOG_NAME), not to the terminal: a start that
fails is one line naming that file. On a CPU, workers of tensor or pipeline parallelism are bound
to cores of their own here (cpu_binding) where vLLM's own binding, a NUMA node per worker, cannot.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import re
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specbench.core.errors import SpecbenchError, first_line
from specbench.engines import LoopThread, Served, arrivals, margin, request_seed

if TYPE_CHECKING:  # the command line checks --engine vllm's options with this module, before torch loads
    from specbench.decoding.sampling import Sampling

INSTALL = (
    "--engine vllm needs vLLM, which lives in an environment of its own: run `make install-vllm` "
    "(CPU; docs/engines.md has the CUDA command), then run .venv-vllm/bin/specbench"
)
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE when unset: enough for a small model's few requests
LOG_NAME = "vllm.log"  # vLLM's own output, in the run's folder: every engine of the run, one after the other
BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's cores for each CPU worker: "0-3|4-7" binds two
BOUND: set[str] = set()  # the bindings said so far


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
    """A started vLLM engine, driven from an event loop on a thread of its own (LoopThread). With
    ``log``, vLLM's own output goes to that file (EngineLog) and a start that fails says so."""

    def __init__(self, spec: EngineSpec, log: Path | None = None):
        if not available():
            raise SpecbenchError(INSTALL)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        # vLLM logs every step of its start: all of it to the log file; without one only its errors
        # (VLLM_LOGGING_LEVEL sets it).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if log is not None else "ERROR")
        self.log = EngineLog(log, spec) if log is not None else None
        self.driver = LoopThread()
        self.llm = None
        try:
            self.llm = self.driver.wait(self._start(spec))
        except BaseException:
            self.close()
            raise
        self.requests = 0
        self.detokenizes = not spec.kwargs()["skip_tokenizer_init"]

    async def _start(self, spec: EngineSpec):
        with self.log.starting() if self.log is not None else _nothing():
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM

            binding = None
            if current_platform.is_cpu() and spec.parallel.get("distributed_executor_backend") != "ray":
                binding = cpu_binding(workers(spec), os.sched_getaffinity(0), numa_nodes(), os.environ.get(BIND))
            if binding is not None and binding not in BOUND:  # said once a process
                BOUND.add(binding)
                logging.getLogger("specbench").info(
                    "vLLM's %d CPU workers bound to cores %s (%s=%s; set it to bind them otherwise)",
                    workers(spec),
                    binding.replace("|", ", "),
                    BIND,
                    binding,
                )
            try:
                with environment({BIND: binding} if binding is not None else {}):
                    return AsyncLLM.from_engine_args(AsyncEngineArgs(**spec.kwargs()))
            except TypeError as e:  # an --engine-args key vLLM does not have
                raise SpecbenchError(f"vLLM refused its arguments ({e}): check --engine-args") from None
            except Exception as e:
                if self.log is None:
                    raise SpecbenchError(f"vLLM could not start the engine for {spec.model}: {first_line(e)}") from None
                said = self.log.error_line() or first_line(e)
                self.log.write("".join(traceback.format_exception(e)))
                raise SpecbenchError(
                    f"vLLM could not start the engine for {spec.model}: {said}{self.log.where}"
                ) from None

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
        try:
            yield from self.driver.stream(len(requests), drive, "the vLLM engine")
        except SpecbenchError as e:
            raise SpecbenchError(self.log.explained(str(e)) if self.log is not None else str(e)) from None

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
        try:
            if self.llm is not None:
                self.driver.wait(self._stop())
                self.llm = None
            self.driver.close()
        finally:
            if self.log is not None:
                self.log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def on_cpu(device: str) -> bool:
    """Whether vLLM runs on this machine's CPU (--device cpu, or no GPU that torch sees)."""
    import torch

    return device == "cpu" or not torch.cuda.is_available()


def device_count(device: str) -> tuple[int, str]:
    """The devices vLLM can split a model over here: the GPUs, or on a CPU machine its cores."""
    import torch

    if not on_cpu(device):
        return torch.cuda.device_count(), "GPU(s)"
    return len(os.sched_getaffinity(0)), "CPU cores"


def workers(spec: EngineSpec) -> int:
    """The worker processes of ``spec``'s engine on this machine: tensor times pipeline parallel size."""
    return spec.parallel.get("tensor_parallel_size", 1) * spec.parallel.get("pipeline_parallel_size", 1)


def cpu_binding(workers: int, cores: Iterable[int], numa_nodes: int, given: str | None) -> str | None:
    """What VLLM_CPU_OMP_THREADS_BIND is set to for ``workers`` CPU workers: nothing where the user
    set it (``given``), for one worker, or where vLLM's own binding (a NUMA node per worker) finds a
    node each; else the usable ``cores`` split between the workers (cpu_split)."""
    if given is not None or workers <= 1 or numa_nodes >= workers:
        return None
    return cpu_split(cores, workers)


def cpu_split(cores: Iterable[int], parts: int) -> str:
    """``cores`` in order, cut into ``parts`` groups as equal as they go, in VLLM_CPU_OMP_THREADS_BIND's
    form: "0|1" for cores 0 and 1 in two, "0-3|4-7" for eight, "0-2|3,5" for cores 0 to 3 and 5.
    Fewer cores than parts are refused in one line that names the setting."""
    cores = sorted(set(cores))
    if len(cores) < parts:
        raise SpecbenchError(
            f"{parts} vLLM CPU workers (--tensor-parallel-size x --pipeline-parallel-size) need a core each and "
            f"this process may use {len(cores)}: lower them, or bind the workers yourself with {BIND}"
        )
    size, larger = divmod(len(cores), parts)
    groups, at = [], 0
    for part in range(parts):
        groups.append(cores[at : at + size + (part < larger)])
        at += len(groups[-1])
    return "|".join(ranges(group) for group in groups)


def ranges(ids: list[int]) -> str:
    """Sorted ids as runs: [0, 1, 2, 5] is "0-2,5"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def numa_nodes() -> int:
    """The NUMA nodes vLLM's own CPU binding may use here (1 where vLLM cannot say)."""
    try:
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        return len(get_visible_memory_node())
    except Exception:  # an older or newer vLLM without it: bind as on one node
        return 1


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ meanwhile (what processes started meanwhile inherit)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# A line of a Python traceback that says what was raised: "AssertionError: Not enough ...", after
# vLLM's prefix of a process's lines ("(EngineCore pid=7) ERROR 11-28 13:18:48 [core.py:1510] ").
RAISED = re.compile(r"(?:^|\] )((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (\S.*)$")


def error_line(text: str) -> str | None:
    """The last line of ``text`` (vLLM's output) that says what was raised, without vLLM's prefix or
    the exception's module; None if none does. vLLM's "See root cause above" is not one."""
    for line in reversed(text.splitlines()):
        found = RAISED.search(line.strip())
        if found and "See root cause above" not in found.group(2):
            return f"{found.group(1).rsplit('.', 1)[-1]}: {found.group(2)}"
    return None


class EngineLog:
    """vLLM's output while an engine lives, appended to ``path`` under a line naming the engine.

    vLLM writes from this process (its loggers, named vllm) and from the processes it starts: the
    engine core, and a worker per device under tensor or pipeline parallelism. Those inherit their
    output from this process's descriptors 1 and 2 as they start: while the engine starts, those
    point at the log (``starting``), and sys.stdout and sys.stderr keep writing where they did, so
    specbench's own lines and progress stay on the terminal. This process's vLLM loggers write to
    the log from the start until the engine is closed."""

    def __init__(self, path: Path, spec: EngineSpec):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8", buffering=1)
        self.began = self.file.tell()
        speculative = spec.speculative["method"] if spec.speculative else "no speculation"
        self.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} vLLM engine: {spec.model}, {speculative}\n")
        self.moved: list[tuple[logging.StreamHandler, object]] = []
        # Where vLLM's loggers in this process write: descriptor 1, not a sys.stdout that a display replaced.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.__stdout__")
        os.environ.setdefault("VLLM_LOGGING_COLOR", "0")  # a file holds no colours

    def write(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Descriptors 1 and 2 to the log meanwhile; sys.stdout and sys.stderr, where they wrote
        to those descriptors, to copies of them; vLLM's loggers to the log."""
        streams = {"stdout": 1, "stderr": 2}
        for name in streams:
            _flush(getattr(sys, name))
        _flush(sys.__stdout__)
        _flush(sys.__stderr__)
        saved = {fd: os.dup(fd) for fd in streams.values()}
        kept = {}
        for name, fd in streams.items():
            stream = getattr(sys, name)
            if _descriptor(stream) == fd:
                kept[name] = stream
                copy = open(os.dup(saved[fd]), "w", encoding=getattr(stream, "encoding", None) or "utf-8", buffering=1)
                setattr(sys, name, copy)
        vllm = logging.getLogger("vllm")
        mine = logging.StreamHandler(self.file)
        # Records before vLLM configures its loggers (at import: "Triton is installed, but ...").
        alone, propagates = not vllm.handlers, vllm.propagate
        if alone:
            vllm.addHandler(mine)
            vllm.propagate = False
        try:
            for fd in streams.values():
                os.dup2(self.file.fileno(), fd)
            yield
        finally:
            _flush(sys.__stdout__)
            _flush(sys.__stderr__)
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            for name, stream in kept.items():
                getattr(sys, name).close()
                setattr(sys, name, stream)
            if mine in vllm.handlers:  # vLLM did not configure its loggers meanwhile
                vllm.removeHandler(mine)
                vllm.propagate = propagates
            self.follow()

    def follow(self) -> None:
        """vLLM's loggers in this process write to the log until close."""
        for handler in logging.getLogger("vllm").handlers:
            if type(handler) is logging.StreamHandler and handler.stream is not self.file:
                self.moved.append((handler, handler.setStream(self.file)))

    def error_line(self) -> str | None:
        """What this engine's part of the log last says was raised (error_line)."""
        _flush(sys.__stdout__)
        _flush(sys.__stderr__)
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.began)
            return error_line(f.read())

    @property
    def where(self) -> str:
        return f" (vLLM's output: {self.path})"

    def explained(self, failure: str) -> str:
        """``failure``, a line saying the engine failed mid-run (its engine core's "EngineDeadError: ...
        See stack trace above"), with the root cause the log last names and where the log is."""
        said = self.error_line()
        cause = f"; the log last says {said}" if said and said not in failure else ""
        return f"{failure}{cause}{self.where}"

    def close(self) -> None:
        for handler, stream in reversed(self.moved):
            handler.setStream(stream)
        self.moved.clear()
        if not self.file.closed:
            self.file.close()


def _descriptor(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.StringIO and the like: not a descriptor
        return None


def _flush(stream) -> None:
    try:
        stream.flush()
    except (AttributeError, OSError, ValueError):
        pass
