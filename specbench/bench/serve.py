"""A serving engine's part of a run (vLLM in this process, or running servers): it opens each engine
(its baseline, then each method), sends every turn in waves at each load, and yields what came back.

It is given a ServingRun, what the run's options say of the serving engines (bench.serving_run reads
them once), and the prompts. It writes nothing and makes no row: it yields Steps and Answers, and
bench/run.py turns each Answer into a records.csv row (serving.record) and writes it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from specbench.core.errors import SpecbenchError
from specbench.decoding.sampling import Sampling, synthetic_rates
from specbench.engines import Served
from specbench.engines.launch import launched
from specbench.engines.server import Server
from specbench.engines.vllm import LOG_NAME, Engine, EngineSpec
from specbench.methods.base import Decoder
from specbench.methods.served import Remote
from specbench.models.pair import Conversations
from specbench.results.rundir import block_key
from specbench.workloads.prompts import Turn

log = logging.getLogger("specbench")


@dataclass
class Progress:
    """What the benchmark is doing: a stage, and for decoding how far it got."""

    stage: str
    done: int = 0
    total: int = 0
    label: str = ""


@dataclass
class ServingRun:
    """What the serving engines of a run are opened and driven with.

    vLLM: ``target`` is the engine of the target alone, each method's the same with its speculative
    config (``draft``, ``speculator``: the directories that config names), ``draft_alone`` the draft
    model's engine. Servers: each method is a methods.Remote; ``draft_server`` serves the draft alone;
    ``api``, ``api_key``, ``timeout_s`` and ``encode`` are how every server is spoken to."""

    engine: str  # "vllm", "server" or "llama-cpp"
    baseline: Decoder
    plan: list[Decoder]
    loads: list[tuple[int, float]]  # (requests in flight, request rate)
    sampling: Sampling
    warmup: int  # untimed requests of the first prompt before an engine is timed
    out: Path  # the run directory (a launched server's log goes in out/servers)
    target: EngineSpec | None = None
    draft_alone: EngineSpec | None = None
    draft: str | None = None
    speculator: str | None = None
    draft_server: Remote | None = None
    api: str = "completions"
    api_key: str | None = field(default=None, repr=False)  # from the environment; never written
    timeout_s: float = 600.0
    encode: Callable[[str], list[int]] | None = None  # text to the target's ids (servers that answer in text)
    own_vocabulary: bool = False  # vLLM: the draft's tokenizer is not the target's

    def spec(self, decoder: Decoder | None) -> EngineSpec:
        """The vLLM engine of ``decoder`` (None: the draft model alone)."""
        if decoder is None:
            return self.draft_alone
        speculative = decoder.method.speculative_config(decoder.k, self.draft, self.speculator)
        if speculative is not None and self.own_vocabulary and speculative["method"] == "draft_model":
            # vLLM's token-level intersection (its VocabMapping): the draft's logits cut to the shared tokens.
            speculative = {**speculative, "use_heterogeneous_vocab": True}
        if speculative is not None and (acceptance := self.sampling.synthetic_acceptance) is not None:
            # vLLM's rates are unconditional per position, as llama.cpp's: the same law as specbench's loop.
            rates = synthetic_rates(acceptance, decoder.k)
            speculative = {**speculative, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates}
        return replace(self.target, speculative=speculative)


@dataclass
class Answer:
    """One request's outcome at a load, with the baseline's on the same turn (None: it failed or was
    not sent), ``ids`` the prompt as the target's ids."""

    turn: Turn
    index: int
    ids: list[int]
    decoder: Decoder
    load: tuple[int, float]
    served: Served
    base: Served | None


@dataclass
class Counters:
    """An engine's speculative-decoding counters before and after one block."""

    decoder: Decoder
    load: tuple[int, float]
    before: dict
    after: dict


def serve_all(
    run: ServingRun,
    conversations: Conversations,
    finished: set[tuple],
    kept: dict[tuple[int, float], dict[int, Served]],
) -> Iterator[Progress | Answer | Counters]:
    """Every turn through each engine at each load: the baseline first, then each method (vLLM: at
    each K, an engine each; servers: each server). Blocks in ``finished`` (block keys, see
    rundir.block_key) are skipped; ``kept`` holds the baseline's requests a resumed run kept, by load.

    At a load the turns go in waves: every conversation's first turn, then every second turn rendered
    after that engine's own first answers, and so on. A baseline that stops answering ends the run."""
    baselines = {load: dict(kept.get(load, {})) for load in run.loads}
    for decoder in [run.baseline, *run.plan]:
        todo = [load for load in run.loads if not finished_block(decoder, load, finished)]
        if not todo:
            continue
        yield Progress(
            f"{opening(run, decoder)}: {decoder.label}" + (" (a minute or two)" if run.engine == "vllm" else "")
        )
        failed = []
        with opened(run, conversations, decoder) as engine:
            for load in todo:
                before = engine.counters() if engine is not None else {}
                for event in serve_block(engine, decoder, load, conversations, run.sampling, run.api, baselines[load]):
                    if isinstance(event, Answer) and event.served.error:
                        failed.append(event.served.error)
                    yield event
                if decoder is not run.baseline and engine is not None:
                    yield Counters(decoder, load, before, engine.counters())
            if decoder is run.baseline and failed:
                # Every other row is compared with the baseline's: a baseline that is gone ends the run.
                try:
                    engine.check()
                except SpecbenchError as e:
                    raise SpecbenchError(
                        f"the baseline stopped answering ({e}): the rows so far are in {run.out}; start it again "
                        "and run the same command with --resume"
                    ) from None
                log.warning("%d baseline requests failed (%s); the others are compared", len(failed), failed[0])


def serve_block(
    engine, decoder: Decoder, load, conversations: Conversations, sampling: Sampling, api: str, baselines: dict
) -> Iterator[Progress | Answer]:
    """Every turn through ``engine`` at one load (concurrency, request rate), in waves by turn. The
    baseline's own requests go into ``baselines`` (prompt index -> Served)."""
    turns, is_baseline = conversations.turns, decoder.method.takes_k is False
    answers: dict[int, list[str]] = {}  # conversation -> this engine's answers so far
    finished = 0
    for wave in range(1, max(t.turn for t in turns) + 1):
        indices = [i for i, t in enumerate(turns) if t.turn == wave]
        ids = [conversations.ids(turns[i], answers.get(turns[i].conversation, [])) for i in indices]
        if api == "chat":
            requests = [conversations.messages(turns[i], answers.get(turns[i].conversation, [])) for i in indices]
        else:
            requests = [x.tolist() for x in ids]
        if engine is None:  # a server that could not be reached: each of its requests failed, for that reason
            outcomes = (Served(n, [], 0.0, 0.0, 0.0, None, error=decoder.state) for n in range(len(indices)))
        else:
            outcomes = engine.run(requests, load[0], sampling, load[1], indices)
        for served in outcomes:
            n = served.index  # its place in this wave's requests
            index = indices[n]
            turn, served = turns[index], replace(served, index=index)
            if is_baseline:
                baselines[index] = served
            if turn.turn < len(turn.prompt.turns) and not served.error:
                answer = served.text.strip() or conversations.answer(served.tokens)
                answers.setdefault(turn.conversation, []).append(answer)
            yield Answer(
                turn, index, ids[n].tolist(), decoder, load, served, served if is_baseline else baselines.get(index)
            )
            finished += 1
            yield Progress("decoding", finished, len(turns), f"{decoder.method.engine} {decoder.label}, {_load(load)}")


def margins(
    run: ServingRun, conversations: Conversations, asked: list[tuple[list[int], int]]
) -> Iterator[Progress | float | None]:
    """The baseline's top-two log-probability margin at each (prompt ids, position) of ``asked``, in
    order, asked of it untimed (a launched baseline is started again for it)."""
    yield Progress(f"labelling {len(asked)} divergent outputs by the baseline's logprobs")
    with opened(replace(run, warmup=0), conversations, run.baseline) as engine:
        for ids, position in asked:
            yield engine.margin_at(ids, position)


def draft_alone(run: ServingRun, conversations: Conversations) -> Iterator[Progress | Served]:
    """The draft model alone at one request in flight, each first turn once, for c (vLLM: an engine
    of the draft; servers: the draft's server)."""
    yield Progress(f"starting {run.engine}: the draft model alone, for c")
    with opened(run, conversations, None) as engine:
        yield from engine.run([ids.tolist() for ids in conversations.first], 1, run.sampling)


@contextmanager
def opened(run: ServingRun, conversations: Conversations, decoder: Decoder | None) -> Iterator:
    """The engine of ``decoder`` (None: the draft model alone), warmed up by ``run.warmup`` untimed
    requests of the first prompt; closed on exit. vLLM's output goes to out/vllm.log. A server
    specbench launches is started first (its log in out/servers) and stopped after. A speculating
    server that cannot be started or reached yields None and its reason in decoder.state (its
    requests are recorded as failed, and the run goes on to the next); the baseline's is an error."""
    if run.engine == "vllm":
        with warmed_up(Engine(run.spec(decoder), log=run.out / LOG_NAME), run, conversations) as engine:
            yield engine
        return
    remote = run.draft_server if decoder is None else decoder.method
    with ExitStack() as stack:
        # A log per server: llama.cpp's methods, and --launch commands with {k}, run a server per K.
        per_k = decoder is not None and decoder.k and remote.server_per_k
        log_name = f"{remote.name}-k{decoder.k}" if per_k else remote.name
        try:
            url = (
                stack.enter_context(
                    launched(log_name, remote.command, run.out / "servers", who=launcher(remote, per_k and decoder.k))
                )
                if remote.command
                else remote.url
            )
            server = Server(
                remote.name,
                url,
                api=run.api,
                api_key=run.api_key,
                timeout_s=run.timeout_s,
                encode=run.encode,
                fresh_connections=remote.engine == "llama-cpp",
            )
        except SpecbenchError as e:
            if not remote.takes_k:  # the baseline, or the draft alone
                raise
            log.warning("%s: its requests are recorded as failed", e)
            decoder.state = str(e)
            yield None
            return
        yield stack.enter_context(warmed_up(server, run, conversations))


@contextmanager
def warmed_up(engine, run: ServingRun, conversations: Conversations) -> Iterator:
    """``engine`` after ``run.warmup`` untimed requests of the first prompt; closed on exit."""
    with engine:
        first = conversations.turns[0]
        request = conversations.messages(first, []) if run.api == "chat" else conversations.first[0].tolist()
        for _ in range(run.warmup):
            list(engine.run([request], 1, run.sampling))
        yield engine


def opening(run: ServingRun, decoder: Decoder) -> str:
    """What opening ``decoder``'s engine is: starting one (vLLM's, or a server specbench launches), or
    connecting to a server that runs already."""
    if run.engine == "vllm" or decoder.method.command:
        return f"starting {run.engine}"
    return f"connecting to {run.engine}"


def launcher(remote: Remote, k: int | None) -> str:
    """Who started ``remote``'s server (at ``k``, for a server per K), as its errors say it: llama.cpp's,
    or the user's --launch."""
    at_k = f" at K={k}" if k else ""
    return f"{'llama-server' if remote.engine == 'llama-cpp' else '--launch'} {remote.name}{at_k}"


def finished_block(decoder: Decoder, load: tuple[int, float], finished: set[tuple]) -> bool:
    """Whether the rows ``decoder`` writes at ``load`` are among the ``finished`` blocks (rundir.block_key).
    A server started for each K is known by its K; any other server by its name, whatever K its
    responses said."""
    key = block_key(
        {"engine": decoder.method.engine, "method": decoder.method.name, "k": decoder.k, "concurrency": load[0],
         "request_rate": load[1]}
    )  # fmt: skip
    if decoder.method.engine != "server" or decoder.method.server_per_k:
        return key in finished
    return any(block[:2] == key[:2] and block[3:] == key[3:] for block in finished)


def _load(load: tuple[int, float]) -> str:
    concurrency, rate = load
    return f"{concurrency} in flight" + ("" if math.isinf(rate) else f", {rate:g} requests/s")
