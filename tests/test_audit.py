"""specbench audit: settings and bad input, greedy divergences of servers labelled by the reference's
margins (stub servers on 127.0.0.1), and, marked slow, the audit of specbench's own methods (they
pass), of every known-broken subject (each is flagged at the default sample size) and of the control
arm (it rejects at its nominal rate)."""

import json

import pytest

from benchmarks.stub_server import Stub
from specbench.audit import parse_setting
from specbench.errors import SpecbenchError

from .helpers import one_line_error, specbench


def test_settings_are_read_or_refused():
    assert parse_setting("greedy").greedy
    setting = parse_setting("temperature=0.8, top_k=20,repetition_penalty=1.2")
    assert dict(setting.knobs) == {"temperature": 0.8, "top_k": 20, "repetition_penalty": 1.2}
    sampling = setting.sampling(6, 0, (2,))
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (0.8, 20, 1.0, 1.2)
    assert dict(parse_setting("top_p=0.9").knobs)["temperature"] == 1.0  # sampling unless said otherwise
    for bad, needle in [
        ("temprature=1", "'temprature' is not a setting"),
        ("top_k=1.5", "top_k='1.5' is not a int"),
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
    result = specbench("audit", "--target", tiny_pair[0], "--draft", tiny_pair[1], *args, "--out", str(tmp_path))
    one_line_error(result, needle)
    assert result.returncode == 2 and not (tmp_path / "samples.jsonl").exists()


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
