"""benchmarks/held_out_agreement.py: which held-out answers it compares heads on."""

from benchmarks.held_out_agreement import held_out_by_source

from ..helpers import distill_run


def test_held_out_answers_to_prompts_another_run_trained_on_are_left_out(tmp_path):
    # Every 16th greedy answer is held out: here answers 0, 16 and 32.
    run = distill_run(tmp_path / "run", [[i, i + 1] for i in range(40)])
    held, left_out = held_out_by_source(run)
    assert [e.ids[:2].tolist() for e in held["sharegpt"]] == [[0, 1], [16, 17], [32, 33]] and left_out == 0
    # Another run trained on prompt 16 (its answer 1, not held out) and held out prompt 32 (its answer 0).
    other = distill_run(tmp_path / "other", [[32, 33], [16, 17]] + [[100 + i] for i in range(20)])
    held, left_out = held_out_by_source(run, [other])
    assert [e.ids[:2].tolist() for e in held["sharegpt"]] == [[0, 1], [32, 33]] and left_out == 1
