"""The client-overhead benchmark's parts (benchmarks/client_overhead.py): the recording stub, the
matching of a client's requests with the stub's record, and the error arithmetic. No timing is
asserted: how far a client is off is what the benchmark measures, not a test."""

import json
import math
import urllib.request

import pytest

from benchmarks.client_overhead import block_errors, run_record, serial_of, up_to, vllm_record, within
from benchmarks.stub_server import Stub
from specbench.decoding.sampling import Sampling
from specbench.engines.server import Server


def test_a_recording_stub_tags_each_answer_and_gives_its_send_times_once():
    sampling = Sampling(max_new_tokens=5, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=())
    with Stub(record=True, interval_s=0.001) as stub, Server("stub", stub.url) as server:
        served = list(server.run([[1, 2, 3], [4, 5], [6]], 2, sampling))
        root = stub.url.removesuffix("/v1")
        sent = {int(k): v for k, v in json.load(urllib.request.urlopen(root + "/stub/sent")).items()}
        again = json.load(urllib.request.urlopen(root + "/stub/sent"))
    assert again == {}
    assert sorted(serial_of(s.text) for s in served) == [0, 1, 2] == sorted(sent)
    assert all(len(times) == 5 and times == sorted(times) for times in sent.values())
    assert all(len(s.tokens) == 5 and len(s.itl) == 4 for s in served)  # the tag is text, not a token
    measured = [{"serial": serial_of(s.text), "itl": s.itl, "tpot": s.tpot_ms / 1000} for s in served]
    errors = block_errors(measured, sent)
    assert errors["requests"] == 3 and errors["failed"] == 0
    assert all(math.isfinite(errors[name]) for name in ("tpot_err_p99", "itl_err_p99", "itl_p99_err"))


def test_errors_are_relative_to_the_servers_own_gaps_and_unmatched_requests_fail():
    sent = {0: [0.0, 0.010, 0.020, 0.030], 1: [1.0, 1.020, 1.040]}  # stub 1 ran late: 20 ms gaps
    measured = [
        {"serial": 0, "itl": [0.011, 0.009, 0.010], "tpot": 0.0105},
        {"serial": 1, "itl": [0.020, 0.022], "tpot": 0.021},
        {"serial": None, "itl": [0.01], "tpot": 0.01},  # no tag: not the stub's
        {"serial": 0, "itl": [0.01], "tpot": 0.01},  # fewer chunks than the stub sent
    ]
    errors = block_errors(measured, sent)
    assert errors["requests"] == 2 and errors["failed"] == 2
    gaps = sorted([0.1, 0.1, 0.0, 0.0, 0.1])  # |client / server - 1| of each gap
    assert errors["itl_err_p50"] == pytest.approx(gaps[2])
    assert errors["tpot_err_p50"] == pytest.approx((0.05 + 0.05) / 2)  # 10.5 / 10 and 21 / 20
    assert errors["server_itl_p50_ms"] == pytest.approx(10.0)
    assert errors["itl_p50_err"] == pytest.approx(0.011 / 0.010 - 1)  # the medians of the pooled gaps


def test_verdicts_hold_up_to_the_first_load_that_fails_one():
    base = dict.fromkeys(("tpot_err_p50", "tpot_err_p99", "itl_err_p50", "itl_err_p99"), 0.01)
    base.update(dict.fromkeys(("tpot_p50_err", "tpot_p99_err", "itl_p50_err", "itl_p99_err"), -0.01), failed=0)
    rows = []
    for concurrency, tpot_p99, itl_p99 in [(1, 0.01, 0.2), (4, 0.049, 0.01), (16, 0.06, 0.01), (64, 0.01, 0.01)]:
        row = {**base, "client": "specbench", "concurrency": concurrency, "tpot_err_p99": tpot_p99}
        row["itl_p99_err"] = itl_p99
        row.update({f"{v}_within_5pct": within(row, v) for v in ("tpot", "itl", "itl_p99")})
        rows.append(row)
    assert up_to(rows, "specbench", "tpot") == 4  # 64 passes again, but 16 did not
    assert up_to(rows, "specbench", "itl") == 64
    assert up_to(rows, "specbench", "itl_p99") is None
    assert not within({**base, "failed": 1}, "itl")


def test_vllms_saved_result_gives_each_requests_tag_gaps_and_tpot(tmp_path):
    result = {
        "duration": 2.0,
        "total_output_tokens": 8,
        "generated_texts": ["#7 w1 w2 w3 w4", ""],
        "itls": [[0.01, 0.01, 0.01], []],
        "ttfts": [0.05, 0.0],
        "latencies": [0.08, 0.0],
        "output_lens": [4, 0],
        "errors": ["", "refused"],
    }
    (tmp_path / "r.json").write_text(json.dumps(result))
    record = vllm_record(tmp_path / "r.json")
    first, failed = record["requests"]
    assert first["serial"] == 7 and first["itl"] == [0.01] * 3 and first["tpot"] == pytest.approx(0.01)
    assert failed["serial"] is None and math.isnan(failed["tpot"])
    assert record["tokens_per_s"] == 4.0


def test_a_specbench_runs_records_are_matched_by_each_answers_tag(tmp_path):
    outputs = [
        {"method": "baseline", "prompt_index": 0, "text": "#3 w1 w2 w3"},
        {"method": "stub", "prompt_index": 0, "text": "#9 w1 w2 w3"},
    ]
    (tmp_path / "outputs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outputs))
    rows = [
        "method,prompt_index,itl_ms,tpot_ms,error",
        "baseline,0,10.000 12.000,11.0,",
        "stub,0,9.000 10.000,9.5,",
        "stub,1,,,HTTP 500: internal error",
    ]
    (tmp_path / "records.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "summary.csv").write_text("method,throughput\nbaseline,100.0\nstub,300.0\n")
    record = run_record(tmp_path)
    assert record["tokens_per_s"] == 200.0
    base, spec, failed = record["requests"]
    assert base == {"serial": 3, "itl": [0.010, 0.012], "tpot": 0.011}
    assert spec["serial"] == 9 and spec["itl"] == [0.009, 0.010]
    assert failed["serial"] is None and failed["itl"] == [] and math.isnan(failed["tpot"])
