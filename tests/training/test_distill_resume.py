"""``specbench distill`` resumes on what --out holds only with the settings it was made with: a run of
another target, --seq-len or recipe is refused in one line that names the setting, before any phase
runs; and options that would fail only once their phase is reached are refused up front."""

import dataclasses
import json

import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import load
from specbench.training.distill import DistillConfig, distill
from specbench.training.stored import SETTINGS

from ..helpers import cli, one_line_error, write_sources

CPU, F32 = torch.device("cpu"), torch.float32
SIZES = dict(hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate_size=64, top_k=8, epochs=1, batch=2)
DATA = dict(seq_len=32, teacher_tokens=64, generate_prompts=2, generate_new_tokens=4, generate_batch=2)


@pytest.fixture
def finished(tiny_pair, tmp_path) -> DistillConfig:
    """A finished tiny distill run: one teacher shard, one shard of answers, a training state."""
    cfg = DistillConfig(
        out=tmp_path / "d", target=tiny_pair[0], sources=[str(write_sources(tmp_path))], **SIZES, **DATA
    )
    list(distill(cfg, load(tiny_pair[0], CPU, F32)))
    assert (cfg.out / "train_state.pt").is_file()
    return cfg


def refusal(cfg: DistillConfig) -> str:
    with pytest.raises(SpecbenchError) as refused:
        cfg.validate()
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_a_run_on_data_of_other_settings_is_refused_naming_them(finished, tiny_pair):
    # The tester's case: a draft of another target would train on this target's labels.
    said = refusal(dataclasses.replace(finished, target=tiny_pair[1]))
    assert f"--target {tiny_pair[0]} -> {tiny_pair[1]}" in said and "teacher" in said and "another --out" in said
    said = refusal(dataclasses.replace(finished, seq_len=16))
    assert "labels of --source" in said and "--seq-len 32 -> 16" in said
    said = refusal(dataclasses.replace(finished, generate_prompts=3))
    assert "answers" in said and "--generate-prompts 2 -> 3" in said
    # A training state of another recipe is not gone on with; without it the stored data train afresh.
    said = refusal(dataclasses.replace(finished, lr=1e-3))
    assert "a training state" in said and "--lr 0.002 -> 0.001" in said and "train_state.pt to make it afresh" in said
    (finished.out / "train_state.pt").unlink()
    dataclasses.replace(finished, lr=1e-3).validate()
    # What changes only how fast it goes, and more --epochs to go on training, resume as before.
    dataclasses.replace(finished, teacher_batch=2, save_every=7, epochs=2).validate()


def test_another_target_on_the_same_out_is_refused_in_one_line_before_any_phase(finished, tiny_pair):
    shards = {p: p.stat().st_mtime_ns for p in finished.out.rglob("*.pt")}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in {**SIZES, **DATA}.items()]
    result = cli("distill", "--target", tiny_pair[1], "--out", finished.out, "--source", *finished.sources, *args)
    one_line_error(result, "--target", tiny_pair[1], "another --out")
    assert shards == {p: p.stat().st_mtime_ns for p in finished.out.rglob("*.pt")}


def test_data_without_a_record_of_its_settings_are_read_by_distill_json_or_refused(finished, tiny_pair):
    # A run from before the settings were recorded: a finished one's distill.json says what they were.
    (finished.out / SETTINGS).unlink()
    finished.validate()
    assert "--seq-len 32 -> 16" in refusal(dataclasses.replace(finished, seq_len=16))
    # distill.json holds --top-k as clamped to the vocabulary: the command as given still resumes (a review)
    recorded = json.loads((finished.out / "distill.json").read_text())
    (finished.out / "distill.json").write_text(json.dumps(recorded | {"top_k": 7}))
    finished.validate()
    (finished.out / "distill.json").unlink()
    assert "no record of the settings" in refusal(finished)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--batch", "0"], ["--batch must be at least 1"]),
        (["--generate-batch", "0"], ["--generate-batch must be at least 1"]),
        (["--heads", "0"], ["--heads must be at least 1"]),
        (["--lr", "-1"], ["--lr -1.0", "must be a finite number, at least 0"]),
        (["--lr", "inf"], ["--lr inf", "must be a finite number"]),
        (["--epochs", "nan"], ["--epochs must be positive"]),
        (["--seq-len", "1"], ["--seq-len 1", "use at least 2"]),
        (["--device", "bogus"], ["--device: use auto, cpu, cuda, cuda:N or mps"]),
    ],
)
def test_bad_training_options_are_refused_in_one_line_before_the_target_loads(tiny_pair, tmp_path, args, needles):
    # Without data to make, the old code reached training at once (and refused there, in other words).
    none = ["--teacher-tokens", "0", "--generate-prompts", "0"]
    one_line_error(cli("distill", "--target", tiny_pair[0], "--out", tmp_path / "o", *none, *args), *needles)
    assert not (tmp_path / "o").exists()


def test_a_draft_vocabulary_beyond_the_targets_is_all_of_it(tiny_pair, tmp_path, caplog):
    target = load(tiny_pair[0], CPU, F32)
    sizes = {**SIZES, **DATA, "generate_prompts": 0}
    cfg = DistillConfig(out=tmp_path / "d", target=tiny_pair[0], sources=[str(write_sources(tmp_path))], **sizes)
    with caplog.at_level("INFO", logger="specbench"):
        list(distill(dataclasses.replace(cfg, draft_vocab=10 * target.width), target))
    assert f"--draft-vocab {10 * target.width} is more than" in caplog.text and f"{target.width} ids" in caplog.text
    assert json.loads((cfg.out / "head_tokens.json").read_text()) == list(range(target.width))
    assert json.loads((cfg.out / "distill.json").read_text())["draft_vocab"] == target.width
