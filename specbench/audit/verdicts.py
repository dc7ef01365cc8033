"""The audit's verdicts, from what its arms answered (audit/run.py draws them).

Per subject and setting: greedy answers equal to the reference's or diverging only at near-ties;
sampled laws that twosample.sequence_law_test cannot tell from the reference's after Holm's
correction, with the TV each test could detect; the controls; and the probes (answers end at their
first stop token, a banned token never appears, logprobs equal the reference's). The arms and groups
are audit/run.py's (Arm, Group), read here by their fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbench.audit import twosample
from specbench.core.metrics import first_divergence
from specbench.results.serving import divergence_kind

BAN = -100.0  # the logit bias that bans a token
LOGPROB_TOLERANCE = 0.01  # nats between a logprob returned with speculation and the reference's
PASS, FAIL, NOT_EXERCISED, INCONCLUSIVE, UNDERPOWERED, NOT_APPLICABLE, NO_ANSWER = (
    "pass",
    "FAIL",
    "not exercised",
    "inconclusive",
    "pass (underpowered)",
    "n/a",
    "no answer",  # the engine refused the setting or failed at it (its error is the evidence): not judged
)


def divergences(ref, arm) -> list[tuple[str, int, int]]:
    """(setting, prompt, position) of each greedy answer of ``arm`` that differs from the reference's
    within the reference's answer (only plain greedy: a margin of the plain logits says nothing of
    a penalised setting)."""
    found = []
    for setting, answers in arm.greedy.items():
        for p, tokens in enumerate(answers):
            at = first_divergence(ref.greedy[setting][p], tokens)
            if at is not None and setting == "greedy":
                found.append((setting, p, at))
    return found


def judge(groups, plan) -> tuple[list[dict], list[dict]]:
    """The verdicts (a row per subject and setting, the controls' and the probes'), and every sampling
    test's figures."""
    strictest = plan.level / plan.tests  # Holm's first step: the detectable TV is stated at it
    subject_tests, control_tests = [], []
    for g in groups:
        for setting in plan.sampled:
            for p in range(len(g.picked)):
                ref = g.ref.samples.get((setting.text, p))
                for arm, tests in [(g.control, control_tests), *((arm, subject_tests) for arm in g.arms)]:
                    if ref is None or setting.text in arm.refused:  # nothing to compare
                        continue
                    law = twosample.sequence_law_test(
                        ref, arm.samples[(setting.text, p)], plan.length, level=strictest, seed=p
                    )
                    tests.append(Tested(g, arm, setting, p, law))
    for tests in (subject_tests, control_tests):
        for t, adjusted in zip(tests, twosample.holm([t.law.p for t in tests]) if tests else [], strict=True):
            t.adjusted = float(adjusted)
    failed_controls = {(id(t.group), t.setting.text) for t in control_tests if t.adjusted < plan.level}
    rows = []
    for g in groups:
        for arm, subject in [(g.control, None), *zip(g.arms, g.subjects, strict=True)]:
            who = {"subject": arm.name if subject else f"{g.reference} (control)", "reference": g.reference}
            who["broken"] = subject.broken if subject else ""
            for setting in plan.settings:
                row = {**who, "setting": setting.text, "seconds": round(arm.seconds.get(setting.text, 0.0), 1)}
                row["drafted"] = arm.drafted.get(setting.text)
                test = "greedy" if setting.greedy else "control" if subject is None else "sampling"
                if why := g.ref.refused.get(setting.text) or arm.refused.get(setting.text):
                    silent = "the reference" if setting.text in g.ref.refused else "it"
                    rows.append(
                        row | {"test": test, "verdict": NO_ANSWER, "evidence": f"{silent} did not answer: {why}"}
                    )
                    continue
                if setting.greedy:
                    rows.append(row | greedy_verdict(g, arm, setting, plan))
                    continue
                family = control_tests if subject is None else subject_tests
                tests = [t for t in family if t.group is g and t.arm is arm and t.setting is setting]
                inconclusive = subject is not None and (id(g), setting.text) in failed_controls
                rows.append(row | sampling_verdict(tests, plan, row["drafted"], subject is None, inconclusive))
            rows += probe_rows(g, arm, who)
    details = [
        {"reference": t.group.reference, "subject": t.arm.name, "setting": t.setting.text} | t.record()
        for t in control_tests + subject_tests
    ]
    return rows, details


@dataclass
class Tested:
    """One sampling test: an arm against its group's reference, at one setting, on one prompt."""

    group: object  # audit.Group
    arm: object  # audit.Arm
    setting: object  # audit.Setting
    prompt: int
    law: twosample.LawTest
    adjusted: float = 1.0  # p after Holm's correction over its family

    def record(self) -> dict:
        t = self.law
        return {
            "prompt": self.group.picked[self.prompt],
            "p": t.p,
            "p_holm": self.adjusted,
            "statistic": t.statistic,
            "df": t.df,
            "tv": t.tv,
            "tv_low": t.tv_low,
            "tv_high": t.tv_high,
            "tv_corrected": t.tv_corrected,
            "tv_noise": t.tv_noise,
            "detectable_tv": t.detectable_tv,
            "positions": [{"position": x.position, "p": x.p, "df": x.df} for x in t.positions],
        }


def sampling_verdict(tests, plan, drafted: int | None, control: bool, inconclusive: bool) -> dict:
    worst = min(tests, key=lambda t: t.adjusted)
    widest = max(tests, key=lambda t: t.law.tv).law
    detectable = max(t.law.detectable_tv for t in tests)
    if not control and drafted == 0:
        verdict, evidence = NOT_EXERCISED, "it drafted nothing"
    elif worst.adjusted < plan.level:
        where = min(worst.law.positions, key=lambda x: x.p) if worst.law.positions else None
        verdict = FAIL
        evidence = f"the law of {plan.length} tokens differs (p {worst.adjusted:.2g} after Holm"
        evidence += f"; most at token {where.position}, p {where.p:.2g})" if where else ")"
    elif inconclusive:
        verdict, evidence = INCONCLUSIVE, "the reference's control failed at this setting"
    elif not detectable <= plan.power_tv:
        verdict, evidence = UNDERPOWERED, f"a test detects TV {detectable:.3f} > --power-tv {plan.power_tv:g}"
    else:
        verdict, evidence = PASS, ""
    return {
        "test": "control" if control else "sampling",
        "verdict": verdict,
        "p": worst.adjusted,
        "tv": widest.tv,
        "tv_low": widest.tv_low,
        "tv_high": widest.tv_high,
        "tv_corrected": widest.tv_corrected,
        "tv_noise": widest.tv_noise,
        "detectable_tv": detectable,
        "samples": plan.samples,
        "prompts": len(tests),
        "evidence": evidence,
    }


def greedy_verdict(g, arm, setting, plan) -> dict:
    equal = {n: 0 for n in plan.greedy_tokens}
    labels = []
    for p, tokens in enumerate(arm.greedy[setting.text]):
        ref = g.ref.greedy[setting.text][p]
        at = first_divergence(ref, tokens)
        for n in plan.greedy_tokens:
            equal[n] += at is None or at >= n
        if at is not None:
            margin = g.margins.get((setting.text, p, at))
            kind = divergence_kind(margin) or "unlabelled"
            labels.append(
                f"prompt {p} at token {at} ({kind}" + (f", margin {margin:.3f} nats)" if margin is not None else ")")
            )
    bad = [x for x in labels if "near-tie" not in x]
    return {
        "test": "greedy",
        "verdict": FAIL if bad else PASS,
        "prompts": len(arm.greedy[setting.text]),
        "equal": ", ".join(f"{equal[n]}/{len(arm.greedy[setting.text])} to {n}" for n in plan.greedy_tokens),
        "evidence": "; ".join(labels),
    }


def probe_rows(g, arm, who: dict) -> list[dict]:
    """The probes of one arm: answers end at their first stop token; the banned token never appears;
    a serving engine's answers end where a stop string appears; logprobs equal the reference's, and
    come for every token the reference's come for."""
    answers = [a for answers in arm.greedy.values() for a in answers] + [a for s in arm.samples.values() for a in s]
    late = [a for a in answers if any(t in g.stop_ids for t in a[:-1])]
    rows = [{**who, "test": "eos", "setting": "all", "verdict": FAIL if late else PASS,
             "evidence": f"{len(late)} answers go on after a stop token" if late else ""}]  # fmt: skip
    if arm is g.control:
        return rows
    if "logit-bias" in arm.refused:
        verdict, evidence = NOT_APPLICABLE, f"no answer under the logit bias: {arm.refused['logit-bias']}"
    elif arm.banned is None:
        verdict, evidence = NOT_APPLICABLE, "not probed (the method takes no logit bias, or nothing was sampled)"
    elif any(g.banned in a for a in g.ref.banned or []):
        verdict, evidence = NOT_APPLICABLE, f"the reference itself produced the banned token {g.banned}"
    else:
        hits = sum(g.banned in a for a in arm.banned)
        verdict = FAIL if hits else PASS
        evidence = f"token {g.banned} banned by logit bias {BAN:g}: in {hits} of {len(arm.banned)} answers"
    rows.append({**who, "test": "logit-bias", "setting": "", "verdict": verdict, "evidence": evidence})
    rows += stop_string_rows(g, arm, who)
    if arm.logprobs is None or g.ref.logprobs is None:
        why = arm.refused.get("logprobs") or g.ref.refused.get("logprobs") or "not returned"
        rows.append({**who, "test": "logprobs", "setting": "greedy", "verdict": NOT_APPLICABLE, "evidence": why})
        return rows
    pairs = list(zip(g.ref.logprobs, arm.logprobs, strict=False))
    gaps = [abs(a[0] - b[0]) for a, b in pairs if a and b]
    missing = sum(1 for a, b in pairs if a and not b)  # the reference's has logprobs, the subject's none
    worst = max(gaps, default=0.0)
    verdict = FAIL if worst > LOGPROB_TOLERANCE or missing else PASS
    evidence = f"largest gap {worst:.2g} nats over {len(gaps)} tokens (tolerance {LOGPROB_TOLERANCE:g})"
    if missing:
        evidence += f"; no logprobs for {missing} of {len(pairs)} tokens"
    rows.append({**who, "test": "logprobs", "setting": "greedy", "verdict": verdict, "evidence": evidence})
    return rows


def stop_string_rows(g, arm, who: dict) -> list[dict]:
    """The stop-string probe of a serving engine (none for specbench's loop, which stops on ids): no
    answer goes on after its text holds the stop string. Several tokens accepted in one round must
    be cut there, as one token at a time would be."""
    row = {**who, "test": "stop-string", "setting": ""}
    if "stop-string" in arm.refused:
        return [
            row
            | {"verdict": NOT_APPLICABLE, "evidence": f"no answer with the stop string: {arm.refused['stop-string']}"}
        ]
    if arm.overruns is None:
        return []
    if g.ref.overruns is None or any(n for n in g.ref.overruns if n):
        return [row | {"verdict": NOT_APPLICABLE, "evidence": "the reference itself does not stop there"}]
    reached = [n for n in arm.overruns if n is not None]
    if not reached:
        return [row | {"verdict": NOT_APPLICABLE, "evidence": f"no answer of {len(arm.overruns)} reached it"}]
    late = [n for n in reached if n > 0]
    evidence = f"{len(reached)} of {len(arm.overruns)} answers reached the stop string"
    if late:
        evidence += f"; {len(late)} went on after it (up to {max(late)} tokens)"
    return [row | {"verdict": FAIL if late else PASS, "evidence": evidence}]
