"""specbench audit: settings and bad input, greedy divergences of servers labelled by the reference's
margins (stub servers on 127.0.0.1), and, marked slow, the audit of specbench's own methods (they
pass), of every known-broken subject (each is flagged at the default sample size) and of the control
arm (it rejects at its nominal rate)."""

import json

import pytest
from scipy.stats import binom

from benchmarks.stub_server import Stub
from specbench.audit.run import Arm, Group, overrun, parse_setting
from specbench.audit.verdicts import stop_string_rows
from specbench.core.errors import SpecbenchError

from ..helpers import audit_workload, cli, one_line_error, specbench


def test_the_stop_string_probe_fails_an_answer_that_goes_on_after_the_string():
    """A round that accepts several tokens at once must still end at the token whose text completes
    the stop string: tokens after it fail the probe; an answer that never reaches it says nothing."""
    words = {1: "a", 2: "b", 3: "END", 4: "c"}

    def decode(ids):
        return " ".join(words[i] for i in ids)

    assert overrun([1, 2, 3], "END", decode) == 0
    assert overrun([1, 3, 4, 4], "END", decode) == 2
    assert overrun([1, 2], "END", decode) is None

    def rows(ref, subject):
        group = Group("ref", [], [], None, (), Arm("reference", overruns=ref), Arm("control"), [], [], {}, "END")
        return stop_string_rows(group, Arm("subject", overruns=subject), {"subject": "s"})

    assert rows([0, None], [0, 0, None])[0]["verdict"] == "pass"
    failed = rows([0, None], [0, 2, None])[0]
    assert failed["verdict"] == "FAIL" and "1 went on after it (up to 2 tokens)" in failed["evidence"]
    assert rows([0], [None, None])[0]["verdict"] == "n/a"  # never reached: no evidence either way
    assert rows([1], [0])[0]["verdict"] == "n/a"  # the reference itself goes on: not speculation's fault
    assert rows([0], None) == []  # not probed: specbench's loop stops on ids


def test_settings_are_read_or_refused():
    assert parse_setting("greedy").greedy
    setting = parse_setting("temperature=0.8, top_k=20,repetition_penalty=1.2")
    assert dict(setting.knobs) == {"temperature": 0.8, "top_k": 20, "repetition_penalty": 1.2}
    sampling = setting.sampling(6, 0, (2,))
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (0.8, 20, 1.0, 1.2)
    assert dict(parse_setting("top_p=0.9").knobs)["temperature"] == 1.0  # sampling unless said otherwise
    for bad, needle in [
        ("temprature=1", "'temprature' is not a setting"),
        ("top_k=1.5", "top_k='1.5' is not a whole number"),
        ("top_p=0", "top_p must be in (0, 1]"),
        ("temperature=-1", "temperature must be >= 0"),
    ]:
        with pytest.raises(SpecbenchError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("'", "'")):
            parse_setting(bad)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--method", "baseline"], "the audit has no subject"),
        (["--broken", "nope"], "--broken nope: choose from draft-argmax"),
        (["--setting", "temprature=1"], "'temprature' is not a setting"),
        (
            ["--method", "tree", "--tree", "2,1", "--setting", "temperature=1,repetition_penalty=1.2"],
            "cannot honour a repetition penalty",
        ),
        (["--setting", "temperature=1,presence_penalty=0.5"], "no presence or frequency penalty"),
        (["--samples", "50", "--power-tv", "0.05"], "--samples 50 cannot promise to detect a TV of 0.05"),
        (["--k", "4", "--length", "3"], "--length 3 is fewer than K + 2 = 6"),
    ],
)
def test_bad_audit_input_is_one_line_before_anything_loads(tiny_pair, tmp_path, args, needle):
    result = cli("audit", "--target", tiny_pair[0], "--draft", tiny_pair[1], *args, "--out", str(tmp_path))
    one_line_error(result, needle)
    assert result.returncode == 2 and not (tmp_path / "samples.jsonl").exists()


def test_the_default_greedy_lengths_fit_the_context_and_given_ones_are_named(tiny_pair, tmp_path):
    """The tiny pair's window is 256 tokens: the default --greedy-tokens (128, 512) is fitted to half of
    what a round leaves, while lengths the user gives that do not fit are refused naming --greedy-tokens
    (the error once named --max-new-tokens, an option of `run` the user never gave)."""
    args = ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--setting", "greedy", "--num-prompts", "1"]
    result = cli("audit", *args, "--prompts", "1", "--out", str(tmp_path / "fitted"))
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-2000:]
    plan = json.loads((tmp_path / "fitted" / "audit.json").read_text())["plan"]
    assert plan["greedy_tokens"] == [125]  # (256 - (K=4 + 1)) // 2: both defaults become that one length
    refused = cli("audit", *args, "--greedy-tokens", "512", "--out", str(tmp_path / "given"))
    one_line_error(refused, "--greedy-tokens 512 plus K does not fit the context window of 256 tokens")
    assert "lower --greedy-tokens" in refused.stderr


@pytest.mark.parametrize("margin,verdict,code", [(0.01, "pass", 0), (1.0, "FAIL", 1)])
def test_a_servers_greedy_divergence_is_a_near_tie_or_structural(tiny_pair, tmp_path, margin, verdict, code):
    """A speculating server whose answer differs from the baseline server's at token 3: a near-tie where
    the baseline's two likeliest tokens there are within a hundredth of a nat, structural (a failure)
    where they are a nat apart. The margin is the reference's, asked of the baseline after the blocks."""
    with Stub(margin=margin) as base, Stub("vllm", k=2, diverge_at=3) as spec:
        result = specbench(
            "audit", "--engine", "server", "--target", tiny_pair[0], "--baseline-url", base.url,
            "--server", f"spec={spec.url}", "--setting", "greedy", "--greedy-tokens", "8,16", "--prompts", "2",
            "--out", str(tmp_path),
        )  # fmt: skip
    assert result.returncode == code, result.stderr[-2000:]
    report = json.loads((tmp_path / "audit.json").read_text())
    row = next(r for r in report["rows"] if r["subject"] == "server spec" and r["test"] == "greedy")
    assert row["verdict"] == verdict and row["equal"] == "0/2 to 8, 0/2 to 16"
    kind = "near-tie" if verdict == "pass" else "structural"
    assert f"prompt 0 at token 3 ({kind}, margin {margin:.3f} nats)" in row["evidence"]
    control = next(r for r in report["rows"] if r["test"] == "greedy" and "control" in r["subject"])
    assert control["verdict"] == "pass" and control["equal"] == "2/2 to 8, 2/2 to 16"  # the baseline agrees with itself
    assert row["drafted"] > 0  # the vLLM-shaped stub says what it drafted
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {(s["arm"], s["prompt"]) for s in samples} >= {("reference", 0), ("reference", 1), ("server spec", 1)}


@pytest.fixture(scope="module")
def audit_pair(tmp_path_factory):
    return audit_workload(tmp_path_factory.mktemp("audit"))


# Where every bug bites: truncation that cuts much of the draft's mass, a temperature, a penalty the
# target's answers run into. The default N must see each bug here.
STRONG = "temperature=1,top_k=3,repetition_penalty=2"
BUG_SETTINGS = ["--setting", "greedy", "--setting", STRONG]


def audit_rows(audit_pair, out, *args) -> tuple[int, dict]:
    target, draft, prompts = audit_pair
    result = specbench(
        "audit", "--target", target, "--draft", draft, "--dataset", prompts, "--num-prompts", "4", "--k", "3",
        "--prompts", "1", "--greedy-tokens", "32", "--threads", "1", *BUG_SETTINGS, *args, "--out", str(out),
        timeout=1500,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    report = json.loads((out / "audit.json").read_text())
    return result.returncode, report


def verdicts(report: dict, subject: str) -> dict:
    return {(r["test"], r["setting"]): r["verdict"] for r in report["rows"] if r["subject"] == subject}


BROKEN = [
    "draft-argmax",
    "q-temperature-1",
    "q-untruncated",
    "draft-bf16",
    "greedy-verify",
    "accept-miscount",
    "penalty-ignored",
]


@pytest.mark.slow
def test_the_audit_passes_specbench_and_flags_every_known_broken_subject(audit_pair, tmp_path):
    """At the default sample size: specbench's loop passes every test (and its control agrees with
    itself), and each known-broken subject fails at least one; a subject that drafts nothing (the
    confidence policy at --draft-p-min 1) is not exercised, never a pass.

    One audit holds every broken subject, so the reference, control and specbench's own arms are
    sampled once (in two audits they took 275 s of the tests' time, in one 240). Holm then corrects
    over all of them: the weakest broken subject, q-temperature-1, failed at p 3e-5 after it, against
    a level of 0.01."""
    flags = [a for name in BROKEN for a in ("--broken", name)]
    code, report = audit_rows(audit_pair, tmp_path, *flags, "--k-policy", "fixed,confidence", "--draft-p-min", "1")
    assert code == 1  # a failure
    assert report["plan"]["samples"] == 1000  # the default N
    own = verdicts(report, "speculative K=3")
    logprobs = own.pop(("logprobs", "greedy"))
    assert set(own.values()) == {"pass"} and len(own) == 2 + 2  # greedy, sampling, the EOS and logit-bias probes
    assert logprobs == "n/a"  # specbench's loop returns no logprobs
    control = verdicts(report, "torch baseline (control)")
    assert set(control.values()) == {"pass"}
    unsure = verdicts(report, "speculative K=3 confidence")
    assert unsure[("sampling", STRONG)] == "not exercised" and unsure[("greedy", "greedy")] == "pass"
    for name in BROKEN:
        found = verdicts(report, f"{name} K=3")
        assert "FAIL" in found.values(), (name, found)
        if name == "accept-miscount":
            assert found[("greedy", "greedy")] == "FAIL"  # greedy answers diverge too, structurally
    samples = (tmp_path / "samples.jsonl").read_text().splitlines()
    arms = {json.loads(line)["arm"] for line in samples}
    assert {"reference", "control", "pilot", "speculative K=3", *(f"{name} K=3" for name in BROKEN)} <= arms
    test = report["tests"][0]
    assert {"p", "p_holm", "df", "tv", "tv_low", "tv_high", "tv_noise", "detectable_tv", "positions"} <= set(test)


@pytest.mark.slow
def test_the_control_rejects_at_its_nominal_rate(audit_pair, tmp_path, one_thread):
    """The reference against an independent second sample of itself, drawn by the audit's own sampler
    (each arm's requests with random streams of their own) under 40 seeds: the share of p below 0.05
    lies in the 99% binomial interval around 0.05."""
    from specbench.audit import twosample
    from specbench.audit.run import CONTROL, REFERENCE, Sampler, first_index
    from specbench.engines.loop import Loop
    from specbench.methods.base import Decoder
    from specbench.methods.registry import BASELINE
    from specbench.models.load import Wanted
    from specbench.models.pair import load_pair

    target, _, prompts = audit_pair
    pair = load_pair(Wanted(target, None, device="cpu"))
    loop = Loop(pair, Decoder(BASELINE), {"draft_p_min": 0.0})
    ids = pair.target.tokenizer(json.loads(open(prompts).readline())["prompt"], return_tensors="pt").input_ids[0]
    setting, seeds, n = parse_setting("temperature=0.7,top_p=0.9"), 40, 300
    ps = []
    for seed in range(seeds):
        sampler = Sampler(tmp_path, seed, tuple(sorted(pair.stop_ids)))
        arms = [
            sampler.draw(loop, str(arm), setting, 0, ids, n, first_index(arm, 0, 0, n), 5)
            for arm in (REFERENCE, CONTROL)
        ]
        sampler.close()
        ps.append(twosample.sequence_law_test(*([s.tokens for s in arm] for arm in arms), 5, resamples=0).p)
    low, high = binom.interval(0.99, seeds, 0.05)
    assert low <= sum(p < 0.05 for p in ps) <= high, ps
