"""``specbench distill``: options that would fail only once their phase is reached (minutes in) are
refused up front, in one line, before the target loads; a --draft-vocab beyond the target's is all of it."""

import dataclasses
import json

import pytest
import torch

from specbench.models.load import load
from specbench.training.distill import DistillConfig, distill

from ..helpers import cli, one_line_error, write_sources

CPU, F32 = torch.device("cpu"), torch.float32
SIZES = dict(hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate_size=64, top_k=8, epochs=1, batch=2)
DATA = dict(seq_len=32, teacher_tokens=64, generate_prompts=2, generate_new_tokens=4, generate_batch=2)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--batch", "0"], ["--batch must be at least 1"]),
        (["--generate-batch", "0"], ["--generate-batch must be at least 1"]),
        (["--heads", "0"], ["--heads must be at least 1"]),
        (["--lr", "-1"], ["--lr -1.0", "must be at least 0"]),
        (["--seq-len", "1"], ["--seq-len 1", "use at least 2"]),
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
