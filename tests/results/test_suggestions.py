"""The lines a run prints after its tables: the K a one-K run's costs predict best, the best K of a
method that pays at no K, what ran each model's forward, and a decode whose steps the forward costs
measured before it do not describe."""

from specbench.bench.run import describe_forward
from specbench.models.costs import Cost, ForwardCosts
from specbench.results.report import best_k_line
from specbench.results.summary import drift_notes, suggestions


def test_a_one_k_run_names_the_k_its_costs_predict_best_and_says_when_none_pays():
    costs = ForwardCosts(
        100, {n: Cost(0.04 + 0.001 * n, 0, 0) for n in range(1, 10)}, Cost(0.002, 0, 0), repeats=1
    )  # c 0.05, wide forwards near free
    row = {"method": "speculative", "predicted_speedup": 2.0, "c": 0.05, "alpha": 0.9}
    (line,) = suggestions([row], costs, [2])
    # a hunt saw the hint say --k 1,2,3,4 when the K it named was 7
    assert "K=8 predicts" in line and "at K=2" in line and line.endswith("`specbench run --k 2,8` measures both")
    assert suggestions([row], costs, [8]) == [] and suggestions([row], costs, [2, 8]) == []
    (none,) = suggestions([{**row, "alpha": 0.05, "c": 0.6}], costs, [2])
    assert "no K predicts a speedup: the best, K=1, predicts 0." in none


def test_the_best_k_line_says_when_no_k_beats_the_baseline():
    picks = {"measured": {"k": 1, "speedup": 0.48}, "predicted": {"k": 2, "speedup": 0.9}}
    assert best_k_line("speculative", picks) == (
        "best K for speculative: measured K=1 (0.48x), predicted K=2 (0.90x); at no K does it beat the baseline"
    )
    picks["predicted"]["speedup"] = 1.2  # the prediction pays where the measurement did not: no such verdict
    assert best_k_line("speculative", picks).endswith("predicted K=2 (1.20x)")


def test_the_forward_line_names_each_route_and_a_small_cache_in_kilobytes():
    graphed = {"route": "graphs", "build_s": 41.0, "graphs": [1, 2], "captured": 16, "capture_s": 0.9}
    graphed |= {"graphs_mb": 9.2, "cache_mb": 512.0, "cache_positions": 2048}
    assert describe_forward("target", graphed) == (
        "target graphs (built in 41.0 s; 16 CUDA graphs captured in 0.9 s, outputs 9 MB; cache 512 MB for 2048 positions)"
    )
    tiny = {"route": "static-inductor", "build_s": 1.0, "cache_mb": 0.16, "cache_positions": 512}
    assert describe_forward("draft", tiny) == "draft static-inductor (built in 1.0 s; cache 164 kB for 512 positions)"
    assert describe_forward("draft", {"route": "eager", "build_s": 0.0}) == "draft eager (transformers' forward)"
    # A CPU's row plan, where it departs from running each count as it comes (meta.json's keys are strings).
    plan = {"1": "1 own", "2": "4 packed", "3": "3 own", "4": "4 packed"}
    assert describe_forward("target", {"route": "packed", "build_s": 2.5, "row_plan": plan}) == (
        "target packed (built in 2.5 s; rows 1, 3 on its own weights; rows padded 2 to 4)"
    )
    unpadded = {"route": "own", "build_s": 0.1, "row_plan": {1: "1 own", 2: "2 own"}}
    assert describe_forward("draft", unpadded) == "draft own (built in 0.1 s)"


def test_a_decode_whose_steps_drifted_from_the_measured_forward_gets_a_note():
    costs = ForwardCosts(100, {1: Cost(0.0514, 0, 0), 2: Cost(0.06, 0, 0)}, Cost(0.004, 0, 0), repeats=1)
    baseline = {"engine": "torch", "method": "baseline", "tpot_p50_ms": 359.8}  # a hunt's busy run: 7x
    (busier,) = drift_notes([baseline], costs)
    assert "359.8 ms a token" in busier and "7.0x the one-token forward measured before it (51.4 ms" in busier
    assert "the machine got busier while it ran" in busier
    (quieter,) = drift_notes([{**baseline, "tpot_p50_ms": 20.0}], costs)
    assert "1/2.6 of the one-token forward" in quieter and "busier while the costs were measured" in quieter
    # the committed CI baselines' decodes took 0.99-1.05x their forward: no note
    assert drift_notes([{**baseline, "tpot_p50_ms": 53.9}], costs) == []
    assert drift_notes([{**baseline, "engine": "vllm"}], costs) == [] and drift_notes([baseline], None) == []


def test_show_says_a_run_stopped_but_not_when_a_served_rows_requests_failed(tmp_path):
    import json

    from specbench.bench.run import Results

    def shown(failed: int, turns: int = 10, prompts: int = 10) -> list[str]:
        row = {"target": "t", "draft": "d", "dataset": "humaneval", "method": "speculative", "num_prompts": 9}
        document = {
            "summary": [row | {"failed": failed}],
            "config": {},
            "resolved": {"turns": turns, "prompts": prompts},
        }
        (tmp_path / "results.json").write_text(json.dumps(document))
        return [note for note in Results.read(tmp_path).suggestions if "stopped" in note]

    (stopped,) = shown(failed=0)
    assert stopped.startswith(
        "this run stopped after 9 of its 10 prompts: `specbench run` with its options and --resume"
    )
    assert shown(failed=1) == []  # a review: a served row counts only the requests that did not fail
    assert "stopped after 9 of its 10 turns" in shown(failed=0, prompts=4)[0]  # a multi-turn run's rows count turns
