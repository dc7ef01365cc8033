"""benchmarks/held_out_agreement.py: which held-out answers it compares heads on."""

import json

import torch

from benchmarks.held_out_agreement import held_out_by_source


def distill_dir(path, prompts: list[list[int]]):
    """A distill output directory of one greedy shard: an answer of two tokens to each prompt."""
    (path / "generated").mkdir(parents=True)
    (path / "features" / "generated").mkdir(parents=True)
    (path / "distill.json").write_text(json.dumps({"sampled_fraction": 0.25}))
    docs = [
        {
            "ids": torch.tensor(prompt + [7, 8]).int(),
            "prompt_len": len(prompt),
            "top_logp": torch.zeros(2, 1),
            "top_idx": torch.zeros(2, 1, dtype=torch.int),
            "source": "sharegpt",
        }
        for prompt in prompts
    ]
    torch.save(docs, path / "generated" / "0000.pt")
    torch.save([torch.zeros(len(d["ids"]), 4) for d in docs], path / "features" / "generated" / "0000.pt")
    return path


def test_held_out_answers_to_prompts_another_run_trained_on_are_left_out(tmp_path):
    # Every 16th greedy answer is held out: here answers 0, 16 and 32.
    run = distill_dir(tmp_path / "run", [[i, i + 1] for i in range(40)])
    held, left_out = held_out_by_source(run)
    assert [e.ids[:2].tolist() for e in held["sharegpt"]] == [[0, 1], [16, 17], [32, 33]] and left_out == 0
    # Another run trained on prompt 16 (its answer 1, not held out) and held out prompt 32 (its answer 0).
    other = distill_dir(tmp_path / "other", [[32, 33], [16, 17]] + [[100 + i] for i in range(20)])
    held, left_out = held_out_by_source(run, [other])
    assert [e.ids[:2].tolist() for e in held["sharegpt"]] == [[0, 1], [32, 33]] and left_out == 1
