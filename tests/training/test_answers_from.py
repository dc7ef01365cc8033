"""``specbench distill --answers-from DIR``: a run trains on earlier runs' answers beside its own. It
draws no prompt they answered, keeps what each run held out held out, trains on one answer per
prompt, and a head reads the features the earlier run stored."""

import json
from pathlib import Path

import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import load
from specbench.training.distill import FEATURES, DistillConfig, load_examples, prompt_of
from specbench.training.distill_eagle import distill_eagle

from ..helpers import cli, distill_run, one_line_error, write_sources

CPU, F32 = torch.device("cpu"), torch.float32


def test_what_any_run_holds_out_is_never_trained_on_and_each_prompt_trains_once(tmp_path):
    p0, p1, p2, p3 = [1, 2], [3, 4], [5, 6], [9, 10]
    # Each run holds out its first answer (every 16th greedy one, counted from 0).
    first = distill_run(tmp_path / "first", [p0, p1, p2])
    second = distill_run(tmp_path / "second", [p1, p0, p3, p2])
    cfg = DistillConfig(out=tmp_path / "new", target="t", generated_repeats=1, answers_from=[str(first), str(second)])
    (cfg.out / "generated").mkdir(parents=True)
    examples, held_out = load_examples(cfg)
    prompts = [tuple(e.ids[: e.start + 1].tolist()) for e in examples]
    # p1 is held out by the second run, so the first run's answer to it is not trained on;
    # p0, held out by the first, is not trained on from the second; p2 trains once.
    assert prompts == [tuple(p2), tuple(p3)]
    assert [tuple(e.ids[: e.start + 1].tolist()) for e in held_out] == [tuple(p0), tuple(p1)]
    # Without --answers-from, a run's own answers are what they were.
    alone = DistillConfig(out=first, target="t", generated_repeats=1)
    examples, held_out = load_examples(alone)
    assert len(examples) == 2 and len(held_out) == 1


def test_earlier_runs_must_be_finished_runs_of_the_same_target(tmp_path):
    earlier = distill_run(tmp_path / "earlier", [[1, 2]], target="other")
    with pytest.raises(SpecbenchError, match="other's, not t's"):
        DistillConfig(out=tmp_path / "new", target="t", answers_from=[str(earlier)]).validate()
    with pytest.raises(SpecbenchError, match="that is --out itself"):
        DistillConfig(out=earlier, target="other", answers_from=[str(earlier)]).validate()
    with pytest.raises(SpecbenchError, match="no finished distill run there"):
        DistillConfig(out=tmp_path / "new", target="t", answers_from=[str(tmp_path / "missing")]).validate()
    with pytest.raises(SpecbenchError, match="--tokenizer-vocab"):
        DistillConfig(out=tmp_path / "new", target="other", tokenizer_vocab=512, answers_from=[str(earlier)]).validate()


def test_a_missing_earlier_run_is_refused_in_one_line(tiny_pair, tmp_path):
    args = ["--target", tiny_pair[0], "--out", str(tmp_path / "new"), "--answers-from", str(tmp_path / "gone")]
    one_line_error(cli("distill", *args), "--answers-from", "no finished distill run", "--out of a run")


def test_a_head_trains_on_an_earlier_runs_answers_and_draws_other_prompts(tiny_pair, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(json.dumps({"id": f"q{i}", "turns": [f"hello number {i}, how are you"]}) + "\n" for i in range(12))
    )
    sizes = dict(seq_len=32, teacher_tokens=0, top_k=8, epochs=1, batch=2, save_every=1, generated_repeats=1)
    data = dict(data=str(chat), generate_prompts=6, generate_new_tokens=4, generate_batch=2, ttt_steps=2)
    common = dict(kind="eagle", target=tiny_pair[0], sources=[str(write_sources(tmp_path))], **sizes, **data)
    target = load(tiny_pair[0], CPU, F32)
    first = DistillConfig(out=tmp_path / "first", seed=0, **common)
    list(distill_eagle(first, target))
    second = DistillConfig(out=tmp_path / "second", seed=0, answers_from=[str(first.out)], **common)
    phases = [p for p in distill_eagle(second, target)]

    def prompts(out: Path) -> set:
        return {prompt_of(doc) for path in (out / "generated").glob("*.pt") for doc in torch.load(path)}

    # The same seed would draw the same prompts: the second run draws the six the first did not.
    assert len(prompts(first.out)) == len(prompts(second.out)) == 6
    assert not prompts(first.out) & prompts(second.out)
    # Its features are this run's own: the first run's were read where that run stored them.
    assert len(list((second.out / FEATURES / "generated").glob("*.pt"))) == 3
    features = [p for p in phases if p.phase == "features"]
    assert features[-1].total == 12  # the sequences of both runs
    examples, held_out = load_examples(second, features=True)
    assert len(examples) + len(held_out) == 12 and len(held_out) == 2  # each run's first answer
    assert all(e.features is not None and len(e.features) == len(e.ids) for e in examples)
    recipe = json.loads((second.out / "distill.json").read_text())
    assert recipe["answers_from"] == [str(first.out)]
