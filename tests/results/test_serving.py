"""The serving engines' summary read across loads: where speculation stops paying (crossover.json)."""

import math


def test_the_load_crossover_is_the_first_load_whose_speedup_interval_reaches_one():
    """crossover.json: per serving method and K, along each load axis that varies, the first load whose
    speedup interval's low end is 1.0 or below (the speedup itself without an interval); None where it
    stays above; the baseline's rows, specbench's own and a block that failed whole say nothing."""
    from specbench.results.serving import crossover_lines, load_crossovers

    def row(method, k, n, speedup, low=None, rate=math.inf, engine="vllm"):
        interval = [low, speedup + 0.1] if low is not None else None
        return {"engine": engine, "method": method, "k": k, "concurrency": n, "request_rate": rate,
                "speedup": speedup, "speedup_ci": interval}  # fmt: skip

    rows = [row("baseline", None, n, 1.0, 0.9) for n in (1, 4, 16)]
    rows += [row("draft", 2, 1, 1.8, 1.5), row("draft", 2, 4, 1.3, 1.05), row("draft", 2, 16, 1.1, 0.97)]
    rows += [row("ngram", 2, 1, 1.4, 1.2), row("ngram", 2, 4, 1.3, 1.1), row("ngram", 2, 16, 1.2, 1.01)]
    rows += [row("eagle3", 3, 16, 0.8), row("eagle3", 3, 4, 0.9), row("eagle3", 3, 1, 1.2)]  # no intervals, any order
    rows += [row("suffix", 2, 1, None), row("suffix", 2, 4, 1.2, 1.1)]  # failed whole at 1
    rows += [row("speculative", 4, 1, 2.0, 1.9, engine="torch")]
    rows += [row("draft", 4, 2, 1.5, 1.2, rate=r) for r in (1.0, 8.0)]  # a request-rate axis at 2 in flight
    found = {(e["method"], e["k"], e["axis"]): e for e in load_crossovers(rows)}
    assert sorted(found) == [
        ("draft", 2, "concurrency"), ("draft", 4, "request_rate"), ("eagle3", 3, "concurrency"),
        ("ngram", 2, "concurrency"), ("suffix", 2, "concurrency"),
    ]  # fmt: skip
    assert found[("draft", 2, "concurrency")]["crossover"] == 16
    assert found[("ngram", 2, "concurrency")]["crossover"] is None
    assert found[("eagle3", 3, "concurrency")]["crossover"] == 4
    assert [p["load"] for p in found[("eagle3", 3, "concurrency")]["points"]] == [1, 4, 16]
    assert found[("suffix", 2, "concurrency")]["crossover"] is None
    rated = found[("draft", 4, "request_rate")]
    assert (
        rated["crossover"] is None and rated["concurrency"] == 2 and [p["load"] for p in rated["points"]] == [1.0, 8.0]
    )
    assert found[("draft", 2, "concurrency")]["request_rate"] == "inf"
    lines = crossover_lines(load_crossovers(rows))
    assert "vllm draft K=2: stops paying at 16 in flight (its speedup's interval first reaches 1.0 there)" in lines
    assert "vllm ngram K=2: pays at every load up to 16 in flight (its speedup's interval stays above 1.0)" in lines
    assert "vllm draft K=4 (2 in flight at most): pays at every load up to 8.0 requests/s" in " ".join(lines)
