"""specbench audit: whether an engine's speculative decoding leaves its outputs unchanged, judged from
outside, by what the engine returns.

A reference (the target alone: the engine's own baseline, or a baseline server) and one or more
subjects (speculative methods of any engine: specbench's loop, transformers' assisted generation,
vLLM, running servers; or a known-broken subject, audit/broken.py) answer the same prompts under each
sampling setting:

- greedy: every subject's answer must equal the reference's token for token, up to each length
  asked for; a divergence where the reference's two likeliest tokens were within serving.NEAR_TIE
  nats is a near-tie (numerics may flip it), any other is structural and fails;
- sampling: N samples of the first L tokens (L at least K + 2, so that rejections, resampling and
  the bonus token all occur) from each arm, on prompts picked for moderate entropy by a pilot sample
  of the reference, judged by twosample.sequence_law_test and Holm-corrected over every subject,
  setting and prompt. A control arm, a second independent sample of the reference, goes through the
  same test: it must pass at the nominal rate, and where it fails, the subjects' verdicts at that
  setting are inconclusive. A subject that drafted nothing is not exercised, never a pass;
- probes that need no statistics: answers end at their first stop token; a token banned with a
  logit bias never appears; logprobs returned with speculation equal the reference's.

Every request has a random stream of its own (engines/: seeded from the run's seed and the request's
index), and no two arms share an index, so the arms are independent samples. Every sample goes to
samples.jsonl as it is drawn; audit.json holds the plan, the seed, the prompts and every verdict with
its evidence.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from specbench.audit import twosample
from specbench.audit.broken import BROKEN
from specbench.audit.verdicts import BAN, divergences, judge
from specbench.bench.config import BenchConfig
from specbench.bench.run import launch_llama_cpp, load_inputs, serving_run
from specbench.bench.serve import Progress, opened
from specbench.core.errors import SpecbenchError
from specbench.core.files import write_text
from specbench.core.machine import environment
from specbench.core.options import AUDIT
from specbench.decoding.sampling import Sampling
from specbench.engines import Served
from specbench.engines.loop import Loop
from specbench.methods.base import Decoder
from specbench.methods.registry import BASELINE, METHODS
from specbench.models.pair import Conversations, Pair, Rendering, encode_prompts

# What a --setting may set: decoding.sampling.Sampling's fields.
KNOBS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}
PILOT = 64  # reference samples per candidate prompt, to pick the prompts of the sampling tests
DIVERSITY = 0.4  # the share of distinct sequences in a pilot that a prompt is picked closest to
CONCURRENCY = 256  # requests in flight to a serving engine while sampling
# llama-server gives each request in flight a slot with a cache of its own, and prefills the prompt
# in each slot that has not yet seen it: 256 slots on 2 cores spent minutes on prefill per wave.
LLAMA_CONCURRENCY = 8
# Arm numbers for request indices: the reference, its control, the pilot, then each subject.
REFERENCE, CONTROL, PILOT_ARM, FIRST_SUBJECT = 0, 1, 2, 3


@dataclass(frozen=True)
class Setting:
    """A sampling setting as --setting gives it: "greedy", or "temperature=0.7,top_p=0.9"."""

    text: str
    knobs: tuple[tuple[str, float], ...]

    @property
    def greedy(self) -> bool:
        return dict(self.knobs)["temperature"] == 0

    def sampling(self, tokens: int, seed: int, stop_ids: tuple[int, ...], **more) -> Sampling:
        return Sampling(max_new_tokens=tokens, seed=seed, stop_ids=stop_ids, **dict(self.knobs), **more)


def parse_setting(text: str) -> Setting:
    """A --setting: "greedy", or KEY=VALUE pairs of KNOBS separated by commas (temperature defaults to 1)."""
    if text.strip() == "greedy":
        return Setting("greedy", (("temperature", 0.0),))
    knobs = {}
    for part in text.split(","):
        key, _, value = (x.strip() for x in part.partition("="))
        if key not in KNOBS:
            raise SpecbenchError(
                f"--setting {text!r}: {key!r} is not a setting; use greedy, or KEY=VALUE,... with keys {', '.join(KNOBS)}"
            )
        try:
            knobs[key] = KNOBS[key](value)
        except ValueError:
            kind = "a whole number" if KNOBS[key] is int else "a number"
            raise SpecbenchError(f"--setting {text!r}: {key}={value!r} is not {kind}") from None
    knobs.setdefault("temperature", 1.0)
    for bad, why in (
        (knobs["temperature"] < 0, "temperature must be >= 0 (0 is greedy)"),
        (knobs.get("top_k", 0) < 0, "top_k must be >= 0"),
        (not 0 < knobs.get("top_p", 1.0) <= 1, "top_p must be in (0, 1]"),
        (not 0 <= knobs.get("min_p", 0.0) < 1, "min_p must be in [0, 1)"),
        (knobs.get("repetition_penalty", 1.0) <= 0, "repetition_penalty must be > 0"),
    ):
        if bad:
            raise SpecbenchError(f"--setting {text!r}: {why}")
    return Setting(text, tuple(knobs.items()))


@dataclass
class Subject:
    """A speculative method of an engine, judged against ``reference``: the same engine's target alone."""

    decoder: Decoder
    reference: Decoder
    broken: str = ""  # a known-broken subject: the engine and issue that shipped its bug

    @property
    def name(self) -> str:
        engine, method = self.decoder.method.engine, self.decoder.method
        if engine == "server":  # its K is the deployment's
            return f"server {method.name}"
        return self.decoder.label if engine == "torch" else f"{engine} {self.decoder.label}"


GREEDY_TOKENS = next(option for option in AUDIT if option.name == "greedy_tokens")


@dataclass
class AuditPlan:
    """What an audit does beside the run's configuration: subjects, settings, sample sizes, levels."""

    subjects: list[Subject]
    settings: list[Setting]
    samples: int  # N per arm, prompt and sampling setting
    length: int  # L, the tokens of each sample
    prompts: int  # prompts per setting
    greedy_tokens: list[int]  # the lengths up to which greedy answers are compared
    level: float  # the family-wise error rate of the subjects' tests (and, apart, of the controls')
    power_tv: float  # the TV each sampling test must detect with 80% power
    fit_greedy: bool = False  # --greedy-tokens not given: its default lengths are fitted to the context window

    @property
    def greedy(self) -> bool:
        return any(s.greedy for s in self.settings)

    @property
    def sampled(self) -> list[Setting]:
        return [s for s in self.settings if not s.greedy]

    @property
    def tests(self) -> int:
        """How many subject tests Holm corrects over: every subject, sampling setting and prompt."""
        return max(1, len(self.subjects) * len(self.sampled) * self.prompts)


@dataclass
class Arm:
    """What one arm answered."""

    name: str
    greedy: dict[str, list[list[int]]] = field(default_factory=dict)  # by setting, per prompt
    samples: dict[tuple[str, int], list[list[int]]] = field(default_factory=dict)  # by (setting, prompt)
    drafted: dict[str, int | None] = field(default_factory=dict)  # by setting (None: not reported)
    seconds: dict[str, float] = field(default_factory=dict)  # by setting
    banned: list[list[int]] | None = None  # answers under the logit-bias ban (None: not probed)
    logprobs: list[list[float]] | None = None  # its first greedy answer's top logprobs (None: not given)
    # Per answer under the stop string: tokens it went on after the string appeared (None: never appeared).
    overruns: list[int | None] | None = None  # None: not probed
    refused: dict[str, str] = field(default_factory=dict)  # setting or probe -> why the engine did not answer


def check(plan: AuditPlan) -> None:
    """Every bad input of an audit, in one line, before any model loads or engine starts."""
    if not plan.subjects:
        raise SpecbenchError(
            "the audit has no subject: give a speculative --method (e.g. speculative; with --engine vllm, draft), "
            "--server NAME=URL, or --broken NAME"
        )
    k = max(s.decoder.k or 0 for s in plan.subjects)
    if plan.sampled and plan.length < k + 2:
        raise SpecbenchError(
            f"--length {plan.length} is fewer than K + 2 = {k + 2} tokens: a round's rejection, resampling and bonus "
            f"token would not all occur; give --length {k + 2} or more"
        )
    best = twosample.detectable_tv(plan.samples, plan.samples, 1, plan.level / plan.tests)
    if plan.sampled and not best <= plan.power_tv:
        raise SpecbenchError(
            f"--samples {plan.samples} cannot promise to detect a TV of {plan.power_tv:g} with 80% power at level "
            f"{plan.level:g} over {plan.tests} tests (a test of one cell detects {best:.3f}): raise --samples, or "
            "--power-tv, or audit fewer settings, prompts or subjects"
        )
    for subject in plan.subjects:
        method = subject.decoder.method
        for setting in plan.settings:
            knobs = dict(setting.knobs)
            own = method.engine in ("torch", "hf")
            if own and (knobs.get("presence_penalty") or knobs.get("frequency_penalty")):
                raise SpecbenchError(
                    f"--setting {setting.text}: {subject.name} runs in this process, which has no presence or "
                    "frequency penalty (vLLM and servers do): drop them, or audit another engine"
                )
            if knobs.get("repetition_penalty", 1.0) != 1.0 and not method.adjusts_logits:
                raise SpecbenchError(
                    f"--setting {setting.text}: {subject.name} cannot honour a repetition penalty (it verifies trees, or "
                    "a level without the context): audit it at settings without one"
                )


def subjects_of(cfg: BenchConfig, broken: list) -> list[Subject]:
    """The run's speculative methods as subjects, each against its engine's target alone, and the
    known-broken ones (specbench's loop at the largest --k)."""
    found = []
    for decoder in cfg.plan:
        if decoder.method.drafts:
            reference = METHODS[decoder.method.reference] if decoder.method.reference else BASELINE
            found.append(Subject(decoder, Decoder(reference)))
    found += [Subject(decoder, cfg.served_baseline) for decoder in cfg.served_plan]
    found += [Subject(Decoder(b, max(cfg.ks)), Decoder(BASELINE), b.where) for b in broken]
    return found


def plan_of(cfg: BenchConfig, given: dict) -> AuditPlan:
    """The audit `cfg` (the run's options, validated) and ``given`` (options.AUDIT's values) ask for."""
    for option in AUDIT:
        option.validate(given[option.name])
    if cfg.synthetic_acceptance is not None:
        raise SpecbenchError(
            "--synthetic-acceptance keeps drafts without verifying them, so nothing it decodes is exact: "
            "the audit judges exactness, drop it"
        )
    if unknown := [name for name in given["broken"] if name not in BROKEN and name != "all"]:
        raise SpecbenchError(f"--broken {unknown[0]}: choose from {', '.join(BROKEN)}, or all")
    broken = list(BROKEN.values()) if "all" in given["broken"] else [BROKEN[name] for name in given["broken"]]
    subjects = subjects_of(cfg, broken)
    k = max([s.decoder.k or max(cfg.ks) for s in subjects], default=max(cfg.ks))
    return AuditPlan(
        subjects,
        [parse_setting(text) for text in given["settings"]],
        given["samples"],
        given["length"] or k + 2,
        given["prompts"],
        given["greedy_tokens"],
        given["level"],
        given["power_tv"],
        fit_greedy=given["greedy_tokens"] == GREEDY_TOKENS.default,
    )


def fitted(lengths: list[int], window: int | None, widest: int) -> list[int]:
    """The default greedy lengths on a model whose context window is ``window``: each capped at half
    of what a forward of ``widest`` tokens leaves, so that prompts keep the other half."""
    if window is None:
        return lengths
    cap = max(1, (window - widest) // 2)
    return sorted({min(n, cap) for n in lengths})


def new_tokens(cfg: BenchConfig, plan: AuditPlan, pair) -> Rendering:
    """How the audit encodes its prompts: room for the longest greedy answer or sample, and the flag
    that set it, named by the error when it does not fit."""
    if plan.fit_greedy:
        windows = [m.context_window for m in (pair.target, pair.draft) if m is not None and m.context_window]
        plan.greedy_tokens = fitted(plan.greedy_tokens, min(windows, default=None), cfg.widest)
    cfg.max_new_tokens = max(max(plan.greedy_tokens), plan.length)
    flag = "--greedy-tokens" if max(plan.greedy_tokens) >= plan.length else "--length"
    return replace(cfg.rendering, new_tokens_flag=flag)


def first_index(arm: int, setting: int, prompt: int, samples: int) -> int:
    """The first request index of an arm's samples of one prompt at one setting: ranges that never
    overlap (up to 1,000 arms and prompts), so no two samples share a random stream."""
    return ((arm * 1000 + setting) * 1000 + prompt) * samples


@contextmanager
def engine_of(pair: Pair, cfg: BenchConfig, conversations: Conversations, decoder: Decoder, out: Path):
    """The engine that decodes with ``decoder``: this process's Loop, or an engine opened as a serving
    benchmark opens one (vLLM started, a server reached or launched)."""
    if decoder.method.engine in ("torch", "hf"):
        with nullcontext(Loop(pair, decoder, cfg.options_of(decoder.method))) as engine:
            yield engine
        return
    run = serving_run(cfg, pair, conversations, out)
    if decoder.method.engine == "llama-cpp":  # a subject or reference of the audit's own: its server's command
        launch_llama_cpp(cfg, pair, conversations, [decoder], None)
    with opened(run, conversations, decoder) as engine:
        if engine is None:
            raise SpecbenchError(
                f"{decoder.method.name} cannot be reached ({decoder.state}): start it, or check its URL"
            )
        yield engine


def drafted(served: list[Served]) -> int | None:
    """Tokens the engine says it drafted for these requests (None: it does not say)."""
    counts = [
        s.measured.result.drafted if s.measured is not None else s.drafted
        for s in served
        if s.measured is not None or s.histogram is not None or s.accepted is not None
    ]
    return sum(counts) if counts else None


class Sampler:
    """Draws answers through an engine; each goes to samples.jsonl as it comes."""

    def __init__(self, out: Path, seed: int, stop_ids: tuple[int, ...]):
        self.seed, self.stop_ids = seed, stop_ids
        self.file = (out / "samples.jsonl").open("a", encoding="utf-8")

    def draw(self, engine, arm: str, setting: Setting, prompt: int, ids, n: int, first: int, tokens: int, **more):
        """``n`` answers of ``tokens`` tokens to prompt ``ids`` at ``setting``, as request indices first..."""
        sampling = setting.sampling(tokens, self.seed, self.stop_ids, **more)
        indices = list(range(first, first + n))
        own = isinstance(engine, Loop)
        request = ids if own else ids.tolist()  # a server takes lists
        batches = not own or hasattr(engine.decoder.method, "decode_many")  # the baselines' sampling batches
        concurrency = min(n, CONCURRENCY) if batches and not setting.greedy else 1
        served = sorted(engine.run([request] * n, concurrency, sampling, indices=indices), key=lambda s: s.index)
        if failed := [s.error for s in served if s.error]:
            raise SpecbenchError(
                f"{arm}: {len(failed)} of {n} requests failed ({failed[0]}): the audit needs every answer"
            )
        extra = {"logit_bias": dict(more["logit_bias"])} if more.get("logit_bias") else {}
        extra |= {"stop": list(more["stop"])} if more.get("stop") else {}
        for s in served:
            row = {"arm": arm, "setting": setting.text, "prompt": prompt, "index": indices[s.index], "tokens": s.tokens}
            self.file.write(json.dumps(row | extra) + "\n")
        self.file.flush()
        return served

    def close(self) -> None:
        self.file.close()


def overrun(tokens: list[int], stop: str, decode) -> int | None:
    """Tokens an answer goes on after its text first holds ``stop`` (None: it never does)."""
    for i in range(1, len(tokens) + 1):
        if stop in decode(tokens[:i]):
            return len(tokens) - i
    return None


def answer(
    sampler: Sampler, engine, name: str, arm: int, plan: AuditPlan, prompts, greedy_ids, ban, stop=None
) -> Iterator[Progress]:
    """Everything one arm answers: the greedy answers to ``greedy_ids``, N samples of each of ``prompts``
    at each sampling setting, then, with a ``ban`` ({token: bias}), the logit-bias probe, and from a
    serving engine its first greedy answer's logprobs and, with ``stop`` ((text, decode)), the
    stop-string probe. Yields progress; returns the Arm."""
    answers, longest = Arm(name), max(plan.greedy_tokens)
    for s, setting in enumerate(plan.settings):
        began, served = time.perf_counter(), []
        todo = greedy_ids if setting.greedy else prompts
        try:
            for p, ids in enumerate(todo):
                yield Progress(f"{name}: {setting.text}", p, len(todo))
                if setting.greedy:
                    got = sampler.draw(engine, name, setting, p, ids, 1, first_index(arm, s, p, 1), longest)
                    answers.greedy.setdefault(setting.text, []).append(got[0].tokens)
                else:
                    first = first_index(arm, s, p, plan.samples)
                    got = sampler.draw(engine, name, setting, p, ids, plan.samples, first, plan.length)
                    answers.samples[(setting.text, p)] = [x.tokens for x in got]
                served += got
        except SpecbenchError as e:  # the engine refuses the setting (or no longer answers): said, not judged
            answers.refused[setting.text] = str(e)
            continue
        answers.drafted[setting.text] = drafted(served)
        answers.seconds[setting.text] = time.perf_counter() - began
    if ban and prompts and plan.sampled:
        yield Progress(f"{name}: logit-bias probe")
        first, biased = first_index(arm, 999, 0, plan.samples), tuple(ban.items())
        try:
            got = sampler.draw(
                engine, name, plan.sampled[0], 0, prompts[0], plan.samples // 4, first, plan.length, logit_bias=biased
            )
            answers.banned = [x.tokens for x in got]
        except SpecbenchError as e:
            answers.refused["logit-bias"] = str(e)
    if not isinstance(engine, Loop) and greedy_ids:
        yield Progress(f"{name}: greedy logprobs")
        greedy, first = parse_setting("greedy"), first_index(arm, 998, 0, 1)
        try:
            got = sampler.draw(engine, name, greedy, 0, greedy_ids[0], 1, first, min(plan.greedy_tokens), logprobs=1)
            answers.logprobs = got[0].logprobs
        except SpecbenchError as e:
            answers.refused["logprobs"] = str(e)
    if stop and not isinstance(engine, Loop) and (greedy_ids if plan.greedy else prompts):
        yield Progress(f"{name}: stop-string probe")
        answers.overruns = []
        text, decode = stop
        # Greedy where the plan has it: deterministic answers, and speculation's longest accepted runs.
        if plan.greedy:
            asked = [(parse_setting("greedy"), p, ids, 1, min(plan.greedy_tokens)) for p, ids in enumerate(greedy_ids)]
        else:
            asked = [(plan.sampled[0], 0, prompts[0], plan.samples // 4, plan.length)]
        try:
            for setting, p, ids, n, tokens in asked:
                got = sampler.draw(engine, name, setting, p, ids, n, first_index(arm, 997, p, n), tokens, stop=(text,))
                answers.overruns += [overrun(x.tokens, text, decode) for x in got]
        except SpecbenchError as e:
            answers.overruns = None
            answers.refused["stop-string"] = str(e)
    return answers


def pick_prompts(sampler: Sampler, engine, plan: AuditPlan, candidates: list) -> Iterator[Progress]:
    """The prompts of the sampling tests: of ``candidates``, those whose pilot sample (PILOT answers of
    the reference at the first sampling setting) is neither near-deterministic (a test would see
    nothing, and rounds would never reject) nor all distinct (a test would have no power): the share
    of distinct sequences closest to DIVERSITY. Returns (picked indices, each candidate's share, the
    pilot's most frequent token)."""
    shares, tokens = [], Counter()
    for c, ids in enumerate(candidates):
        yield Progress("picking prompts (pilot samples of the reference)", c, len(candidates))
        first = first_index(PILOT_ARM, 0, c, PILOT)
        got = sampler.draw(engine, "pilot", plan.sampled[0], c, ids, PILOT, first, plan.length)
        answers = [tuple(x.tokens) for x in got]
        shares.append(len(set(answers)) / PILOT)
        tokens.update(t for a in answers for t in a if t not in sampler.stop_ids)
    varied = [c for c, share in enumerate(shares) if share > 1 / PILOT]
    if not varied:
        raise SpecbenchError(
            f"every candidate prompt gave one answer in {PILOT} samples at {plan.sampled[0].text}: nothing to test; "
            "raise the temperature, or give more prompts (--num-prompts) or another dataset"
        )
    picked = sorted(varied, key=lambda c: abs(shares[c] - DIVERSITY))[: plan.prompts]
    return picked, shares, tokens.most_common(1)[0][0] if tokens else None


@dataclass
class Group:
    """One reference with its control and subjects, as they answered."""

    reference: str
    picked: list[int]  # the candidates the sampling tests use
    shares: list[float]  # each candidate's share of distinct sequences in its pilot
    banned: int | None  # the token the logit-bias probe bans
    stop_ids: tuple[int, ...]
    ref: Arm
    control: Arm
    arms: list[Arm]
    subjects: list[Subject]
    margins: dict[tuple[str, int, int], float | None]  # (setting, prompt, position) -> the reference's margin
    stop_string: str | None = None  # the stop-string probe's string (None: not probed)


def audit(cfg: BenchConfig, plan: AuditPlan, out: Path) -> Iterator[Progress | dict]:
    """Run ``plan`` on the models and engines of ``cfg`` into ``out``; yields Steps, then the report
    (what audit.json holds: the plan, the seed, the prompts, every test and every verdict)."""
    check(plan)
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples.jsonl").unlink(missing_ok=True)
    cfg.warmup = 0  # a warm-up would only take time
    yield Progress("loading models and prompts")
    pair, prompts = load_inputs(cfg)
    # The longest greedy answer sets the room prompts need.
    conversations = encode_prompts(pair, prompts, new_tokens(cfg, plan, pair))
    # Many requests in flight to a serving engine, which answers each prompt N times from its cache.
    # vLLM loads its tokenizer, for the stop-string probe (it matches stop strings in text).
    audited = {"enable_prefix_caching": True, "skip_tokenizer_init": False}
    in_flight = LLAMA_CONCURRENCY if "llama-cpp" in cfg.engines else CONCURRENCY
    cfg.concurrency, cfg.engine_args = [in_flight], audited | cfg.engine_args
    sampler = Sampler(out, cfg.seed, tuple(sorted(pair.stop_ids)))
    report = {"meta": environment(pair.device), "config": cfg.as_dict(), "plan": plan_dict(plan), "groups": []}
    groups = []
    try:
        for reference, subjects in grouped(plan.subjects).items():
            group = yield from audit_group(sampler, pair, cfg, conversations, plan, reference, subjects, out)
            groups.append(group)
            report["groups"].append(group_dict(group))
            write_text(out / "audit.json", json.dumps(report, indent=1))
    finally:
        sampler.close()
    report["rows"], report["tests"] = judge(groups, plan)
    write_text(out / "audit.json", json.dumps(report, indent=1))
    yield report


def grouped(subjects: list[Subject]) -> dict[Decoder, list[Subject]]:
    """Subjects by reference (one per engine)."""
    groups: dict[str, tuple[Decoder, list[Subject]]] = {}
    for subject in subjects:
        key = f"{subject.reference.method.engine}/{subject.reference.method.name}"
        groups.setdefault(key, (subject.reference, []))[1].append(subject)
    return dict(groups.values())


def audit_group(sampler, pair, cfg, conversations, plan, reference, subjects, out) -> Iterator[Progress]:
    """One reference, its control and its subjects, answering. Returns the Group."""
    candidates = conversations.first
    greedy_ids = candidates[: plan.prompts]
    name = f"{reference.method.engine} {reference.method.name}"
    yield Progress(f"starting {name}")
    with engine_of(pair, cfg, conversations, reference, out) as engine:
        picked, shares, frequent = [], [], None
        if plan.sampled:
            picked, shares, frequent = yield from pick_prompts(sampler, engine, plan, candidates)
        prompts = [candidates[c] for c in picked]
        ban = {frequent: BAN} if frequent is not None else {}
        stop = stop_probe(pair, frequent)
        ref = yield from answer(sampler, engine, "reference", REFERENCE, plan, prompts, greedy_ids, ban, stop)
        control = yield from answer(sampler, engine, "control", CONTROL, plan, prompts, greedy_ids, {})
    arms = []
    for j, subject in enumerate(subjects):
        yield Progress(f"starting {subject.name}")
        with engine_of(pair, cfg, conversations, subject.decoder, out) as engine:
            probe = ban if subject.decoder.method.adjusts_logits else {}
            arms.append(
                (
                    yield from answer(
                        sampler, engine, subject.name, FIRST_SUBJECT + j, plan, prompts, greedy_ids, probe, stop
                    )
                )
            )
    group = Group(name, picked, shares, frequent, sampler.stop_ids, ref, control, arms, subjects, {}, stop and stop[0])
    wanted = {key for arm in [control, *arms] for key in divergences(ref, arm)}
    if wanted:
        yield Progress(f"labelling {len(wanted)} greedy divergences by the reference's margins")
        with engine_of(pair, cfg, conversations, reference, out) as engine:
            group.margins = {key: engine.margin_at(greedy_ids[key[1]].tolist(), key[2]) for key in sorted(wanted)}
    return group


def stop_probe(pair: Pair, frequent: int | None):
    """(stop string, decode) for the stop-string probe: the text of the pilot's most frequent token,
    so that answers reach it; None without a token or a tokenizer, or when its text is blank."""
    tokenizer = pair.target.tokenizer
    if frequent is None or tokenizer is None:
        return None
    text = tokenizer.decode([frequent]).strip()
    return (text, tokenizer.decode) if text else None


def group_dict(g: Group) -> dict:
    return {
        "reference": g.reference,
        "candidate_prompts": len(g.shares),
        "pilot_distinct_share": g.shares,
        "picked_prompts": g.picked,
        "banned_token": g.banned,
        "stop_string": g.stop_string,
        "margins": [{"setting": k[0], "prompt": k[1], "position": k[2], "margin": m} for k, m in g.margins.items()],
        "drafted": {arm.name: arm.drafted for arm in g.arms},
    }


def plan_dict(plan: AuditPlan) -> dict:
    return {
        "subjects": [
            {"name": s.name, "engine": s.decoder.method.engine, "k": s.decoder.k, "broken": s.broken}
            for s in plan.subjects
        ],
        "settings": [s.text for s in plan.settings],
        "samples": plan.samples,
        "length": plan.length,
        "prompts": plan.prompts,
        "greedy_tokens": plan.greedy_tokens,
        "level": plan.level,
        "power_tv": plan.power_tv,
        "request_index": "((arm * 1000 + setting) * 1000 + prompt) * samples + i, arm 0 the reference, 1 its control, "
        "2 the pilot, 3... the subjects; its seed: engines.request_seed(seed, index)",
    }
