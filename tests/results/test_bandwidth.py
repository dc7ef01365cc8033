"""How close the baseline came to the hardware: baseline_mbu, its caption line and its note."""

import math

import pytest
from rich.console import Console

from specbench.core import metrics
from specbench.models.costs import Roofline
from specbench.results.report import summary_table
from specbench.results.summary import MBU_FLOOR, bandwidth_notes, roofline_columns


def shown(table) -> str:
    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()


def baseline_record(prompt_tokens: int, new_tokens: int, method_s: float, prefill_s: float) -> dict:
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "method_s": method_s, "prefill_s": prefill_s}


def test_the_baselines_decode_reads_weights_and_cache_against_the_copy_bandwidth():
    # 1 GB of weights and 1 MB of cache a token of context, against 40 GB/s.
    bound = Roofline(bandwidth=40e9, weight_bytes=10**9, kv_bytes_per_token=10**6)
    # Two prompts: 11 tokens in 0.6 s after a 0.1 s prefill (10 steps), 6 in 0.3 s after 0.05 s (5 steps).
    records = [baseline_record(100, 11, 0.6, 0.1), baseline_record(200, 6, 0.3, 0.05)]
    got = roofline_columns(bound, records)
    context = metrics.decode_context_tokens(100, 11) + metrics.decode_context_tokens(200, 6)
    kv = 10**6 * context / 15
    assert got["kv_read_bytes"] == pytest.approx(kv)
    assert got["baseline_mbu"] == pytest.approx((15 / 0.75) * (1e9 + kv) / 40e9)
    assert got["copy_bandwidth_gbs"] == pytest.approx(40.0) and got["weight_bytes"] == 10**9
    assert all(math.isnan(v) for v in roofline_columns(None, records).values())  # not measured: empty


def row(mbu: float, device: str = "cpu", route: str = "packed", **more) -> dict:
    return {
        "engine": "torch",
        "method": "baseline",
        "k": None,
        "device": device,
        "compile": route,
        "baseline_mbu": mbu,
        "copy_bandwidth_gbs": 45.0,
        "weight_bytes": 538_000_000,
        "kv_read_bytes": 8_400_000.0,
        **more,
    }


def test_a_baseline_far_from_the_copy_bandwidth_gets_a_note_and_one_near_it_none():
    (note,) = bandwidth_notes([row(0.213)], graphs_option=True)
    assert "21.3% of the copy bandwidth" in note and "45.0 GB/s" in note
    assert "c, the verify ratio and the speedups are those of a launch-bound loop, not of the pair" in note
    assert "--graphs" not in note  # a CPU: no CUDA graphs to offer
    assert bandwidth_notes([row(MBU_FLOOR)], graphs_option=True) == []
    assert bandwidth_notes([row(0.82)], graphs_option=True) == []
    assert bandwidth_notes([row(math.nan)], graphs_option=True) == []  # not measured
    # A hunt saw 105.9% with no word; the copy timed alone right after gave 24-34 GB/s, not 16.8.
    (over,) = bandwidth_notes([row(1.059)], graphs_option=True)
    assert "105.9% of the copy bandwidth" in over and "baseline_mbu overstates" in over and "launch-bound" not in over
    assert bandwidth_notes([row(0.1, engine="vllm")], graphs_option=True) == []  # only specbench's loop's baseline
    assert bandwidth_notes([{"method": "baseline", "speedup": 1.0}], graphs_option=True) == []  # an older run's row


def test_on_cuda_the_note_points_at_graphs_only_where_the_option_exists_and_the_run_did_not_graph():
    (eager,) = bandwidth_notes([row(0.12, "cuda:0", "eager")], graphs_option=True)
    assert "--graphs" in eager
    (before,) = bandwidth_notes([row(0.12, "cuda:0", "eager")], graphs_option=False)
    assert "--graphs" not in before
    (graphed,) = bandwidth_notes([row(0.3, "cuda:0", "graphs")], graphs_option=True)
    assert "--graphs" not in graphed


def test_the_summary_table_says_the_baselines_mbu_in_its_caption():
    rows = [row(0.213), row(0.213, method="speculative", k=4, speedup=1.4)]
    table = " ".join(shown(summary_table(rows, "run")).split())  # the caption wraps at the table's width
    assert "baseline MBU 21.3% (a step reads 538 MB + 8.4 MB KV; copy 45.0 GB/s)" in table
    assert "more columns: --wide" in table
    assert "baseline MBU 21.3%" in shown(summary_table(rows, "run", wide=True))
    assert "MBU" not in shown(summary_table([row(math.nan)], "run"))  # a run that measured none
