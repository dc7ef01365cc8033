"""A serving engine's part of a run (vLLM in this process, or running servers): its baseline, then
each method, every turn in waves at each load; the draft model alone for c; and, for servers under
greedy, each divergent output labelled by the baseline's logprobs. bench.benchmark calls serve_all;
the rows themselves are serving.py's.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from . import serving
from .config import BenchConfig
from .engines import Sampling, Served
from .engines.launch import launched
from .engines.server import Server
from .engines.vllm import Engine, EngineSpec
from .errors import SpecbenchError
from .method import Decoder
from .pair import Conversations, Pair, model_dir

log = logging.getLogger("specbench")


@dataclass
class Step:
    """What the benchmark is doing: a stage, and for decoding how far it got."""

    stage: str
    done: int = 0
    total: int = 0
    label: str = ""


def engine_spec(pair: Pair, cfg: BenchConfig, conversations: Conversations, decoder: Decoder | None) -> EngineSpec:
    """The vLLM engine for one decoder (None: the draft model alone, for c)."""
    model = model_dir(pair.draft if decoder is None else pair.target)
    draft = model_dir(pair.draft) if pair.draft is not None else None
    windows = [m.context_window for m in (pair.target, pair.draft) if m is not None and m.context_window]
    needed = conversations.longest + cfg.max_new_tokens + cfg.widest
    parallel = {
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        **(
            {"distributed_executor_backend": cfg.distributed_executor_backend}
            if cfg.distributed_executor_backend
            else {}
        ),
    }
    return EngineSpec(
        model=model,
        dtype=str(pair.dtype).removeprefix("torch."),
        seed=cfg.seed,
        max_model_len=min([needed, *windows]),
        max_num_seqs=max(cfg.concurrency),
        speculative=decoder.method.speculative_config(cfg, decoder.k, draft) if decoder is not None else None,
        dummy=cfg.random_weights,
        parallel=parallel,
        extra=cfg.engine_args,
    )


def serve_all(pair, cfg, conversations, writer, records, blocks, engine_costs, counters) -> Iterator[Step]:
    """The serving engine (vLLM in this process, or running servers): its baseline first, then each
    method (vLLM: at each K, an engine each; servers: each --server), every turn at each load.

    At a load the turns go in waves: every conversation's first turn, then every second turn rendered
    after that engine's own first answers, and so on. Each request's row is written as it finishes; a
    resumed run skips the blocks it finished. The draft model alone runs last, one request at a time,
    for c (vLLM: an engine of it; servers: --draft-url)."""
    first = [ids.tolist() for ids in conversations.first]
    sampling = cfg.requests(pair.stop_ids)
    base_step = cfg.served_baseline
    baselines = {load: _served_baseline(records, writer.out, base_step, load) for load in cfg.loads}
    sent: dict[tuple, list[int]] = {}  # (concurrency, rate, prompt_index) -> the baseline's prompt ids
    for decoder in [base_step, *cfg.served_plan]:
        method = decoder.method
        todo = [load for load in cfg.loads if _key(decoder, load) not in blocks]
        if not todo:
            continue
        yield Step(
            f"starting {method.engine}: {decoder.label}" + (" (a minute or two)" if method.engine == "vllm" else "")
        )
        with opened(pair, cfg, conversations, decoder, sampling, writer.out) as engine:
            for load in todo:
                before = engine.counters() if engine is not None else {}
                yield from serve_block(
                    engine,
                    decoder,
                    load,
                    conversations,
                    sampling,
                    writer,
                    records,
                    baselines[load],
                    cfg.api,
                    pair,
                    sent,
                )
                if decoder is not base_step and engine is not None:
                    grew = serving.counter_row(method.engine, method.name, load, before, engine.counters())
                    if grew is not None:
                        counters.append(grew)
                        writer.write_csv("counters.csv", counters)
            if decoder is base_step and (failed := _failed(records, decoder, cfg.loads)):
                # Every other row is compared with the baseline's: a baseline that is gone ends the run.
                try:
                    engine.check()
                except SpecbenchError as e:
                    raise SpecbenchError(
                        f"the baseline stopped answering ({e}): the rows so far are in {writer.out}; start it again "
                        "and run the same command with --resume"
                    ) from None
                log.warning("%d baseline requests failed (%s); the others are compared", len(failed), failed[0])
    if base_step.method.engine == "server" and cfg.temperature == 0 and cfg.api == "completions":
        yield from label_divergences(pair, cfg, conversations, records, writer, sampling, sent)
    yield from draft_alone(pair, cfg, conversations, records, engine_costs, writer, first, sampling)


def label_divergences(pair, cfg, conversations, records, writer, sampling, sent) -> Iterator[Step]:
    """Greedy: each output that diverged from the baseline server's is labelled near-tie or
    structural by the baseline's own top-two margin at the first divergent token, asked of it
    untimed after every block (a launched baseline is started again for it). Rows whose baseline
    prompt this run did not send (kept by --resume) stay unlabelled."""
    todo = [
        r for r in records
        if r["engine"] == "server" and not r["error"] and r["first_divergence"] >= 0 and not r["divergence"]
        and (r["concurrency"], r["request_rate"], r["prompt_index"]) in sent
    ]  # fmt: skip
    if not todo:
        return
    yield Step(f"labelling {len(todo)} divergent outputs by the baseline's logprobs")
    with opened(pair, replace(cfg, warmup=0), conversations, cfg.served_baseline, sampling, writer.out) as engine:
        for r in todo:
            ids = sent[(r["concurrency"], r["request_rate"], r["prompt_index"])]
            r["divergence"] = serving.divergence_kind(engine.margin_at(ids, int(r["first_divergence"])))
    writer.rewrite_records(records)


def serve_block(
    engine, decoder, load, conversations, sampling, writer, records, baselines, api, pair, sent
) -> Iterator[Step]:
    """Every turn through ``engine`` at one load (concurrency, request rate), in waves by turn; the
    baseline's prompt ids go into ``sent``."""
    turns, base_step = conversations.turns, decoder.method.takes_k is False
    encode = encoder(pair)
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
            if base_step:
                baselines[index] = served
                sent[(load[0], load[1], index)] = ids[n].tolist()
            if turn.turn < len(turn.prompt.turns) and not served.error:
                answer = served.text.strip() or conversations.answer(served.tokens)
                answers.setdefault(turn.conversation, []).append(answer)
            base = served if base_step else baselines.get(index)
            row = serving.record(turn, index, ids[n].tolist(), decoder, load, served, base, encode)
            if not served.error:
                text = served.text or (pair.target.tokenizer.decode(served.tokens) if pair.target.tokenizer else "")
                writer.output(
                    turn, index, decoder.k, decoder.method.name, served.tokens, text, "", decoder.method.engine,
                    load[0], decoder.policy, load[1],
                )  # fmt: skip
            records.append(row)
            writer.append_record(row)
            finished += 1
            yield Step("decoding", finished, len(turns), f"{decoder.method.engine} {decoder.label}, {_load(load)}")


def draft_alone(pair, cfg, conversations, records, engine_costs, writer, first, sampling) -> Iterator[Step]:
    """c of a serving engine: the draft's time per output token alone over the target's, both at one
    request in flight (vLLM: an engine of the draft; servers: the --draft-url server)."""
    base_step, engine_name = cfg.served_baseline, cfg.served_baseline.method.engine
    single = [load for load in cfg.loads if load[0] == 1 and math.isinf(load[1])]
    timed = {row["model"] for row in engine_costs if row["engine"] == engine_name}
    if not single:
        return
    if "target" not in timed:
        rows = serving.block(records, engine_name, base_step.method.name, single[0])
        engine_costs.append(serving.decode_cost([r["tpot_ms"] for r in rows], engine_name, "target"))
        writer.write_csv("engine_costs.csv", engine_costs)
    wanted = cfg.draft_server if engine_name == "server" else any(s.method.needs_draft for s in cfg.served_plan)
    if wanted and "draft" not in timed:
        yield Step(f"starting {engine_name}: the draft model alone, for c")
        with opened(pair, cfg, conversations, None, sampling, writer.out) as engine:
            if engine is None:
                return
            alone = [served.tpot_ms for served in engine.run(first, 1, sampling) if not served.error]
        engine_costs.append(serving.decode_cost(alone, engine_name, "draft"))
        writer.write_csv("engine_costs.csv", engine_costs)


@contextmanager
def opened(pair, cfg, conversations, decoder: Decoder | None, sampling: Sampling, out: Path) -> Iterator:
    """The engine of ``decoder`` (None: the draft model alone), warmed up by --warmup untimed requests
    of the first prompt; closed on exit. A server specbench launches is started first (its log in
    out/servers) and stopped after. A speculating server that cannot be reached yields None and its
    reason in decoder.state (its requests are recorded as failed); the baseline's is an error."""
    if cfg.served_baseline.method.engine == "vllm":
        with warmed_up(Engine(engine_spec(pair, cfg, conversations, decoder)), cfg, conversations, sampling) as engine:
            yield engine
        return
    remote = cfg.draft_server if decoder is None else decoder.method
    with ExitStack() as stack:
        url = (
            stack.enter_context(launched(remote.name, remote.command, out / "servers"))
            if remote.command
            else remote.url
        )
        try:
            api_key = os.environ.get(cfg.api_key_env)
            server = Server(
                remote.name, url, api=cfg.api, api_key=api_key, timeout_s=cfg.request_timeout, encode=encoder(pair)
            )
        except SpecbenchError as e:
            if not remote.takes_k:  # the baseline, or the draft alone
                raise
            log.warning("%s: its requests are recorded as failed", e)
            decoder.state = str(e)
            yield None
            return
        yield stack.enter_context(warmed_up(server, cfg, conversations, sampling))


@contextmanager
def warmed_up(engine, cfg: BenchConfig, conversations: Conversations, sampling: Sampling) -> Iterator:
    """``engine`` after --warmup untimed requests of the first prompt; closed on exit."""
    with engine:
        request = (
            conversations.messages(conversations.turns[0], []) if cfg.api == "chat" else conversations.first[0].tolist()
        )
        for _ in range(cfg.warmup):
            list(engine.run([request], 1, sampling))
        yield engine


def encoder(pair: Pair):
    """Text to the target's ids, for a server that answers in text only (None without a tokenizer)."""
    tokenizer = pair.target.tokenizer
    return (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None


def _key(decoder: Decoder, load: tuple[int, float]) -> tuple:
    """rundir.block_key of the rows ``decoder`` writes at ``load``."""
    k = decoder.k if decoder.method.engine == "vllm" else None
    return (decoder.method.engine, decoder.method.name, k, load[0], float(load[1]))


def _load(load: tuple[int, float]) -> str:
    concurrency, rate = load
    return f"{concurrency} in flight" + ("" if math.isinf(rate) else f", {rate:g} requests/s")


def _failed(records: list[dict], decoder: Decoder, loads) -> list[str]:
    """Why each request of ``decoder`` at these loads failed (empty when none did)."""
    rows = [r for load in loads for r in serving.block(records, decoder.method.engine, decoder.method.name, load)]
    return [r["error"] for r in rows if r["error"]]


def _served_baseline(records: list[dict], out: Path, base_step: Decoder, load: tuple[int, float]) -> dict[int, Served]:
    """The baseline's requests at a load that a resumed run kept, rebuilt from their rows and outputs;
    empty for a fresh run."""
    engine, name = base_step.method.engine, base_step.method.name
    rows = [r for r in serving.block(records, engine, name, load) if not r["error"]]
    if not rows:
        return {}
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text(encoding="utf-8").splitlines()]
    tokens = {
        o["prompt_index"]: o["token_ids"]
        for o in outputs
        if o.get("engine") == engine and o["concurrency"] == load[0]
        and float(o.get("request_rate", math.inf)) == load[1] and o["method"] == name
    }  # fmt: skip
    return {
        r["prompt_index"]: Served(
            r["prompt_index"],
            tokens[r["prompt_index"]],
            r["start_s"],
            r["start_s"] + r["ttft_ms"] / 1000,
            r["end_s"],
            None,
            reported=int(r["new_tokens"]),
        )
        for r in rows
    }
