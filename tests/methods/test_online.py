"""--method online on tiny local models: exact under greedy while the draft changes between prompts,
online.csv, training reported apart from decoding, the shipped draft untouched, --save-draft."""

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import load

from ..helpers import cli, one_line_error

ONLINE_COLUMNS = [
    "method",
    "k",
    "k_policy",
    "prompt_index",
    "prompt_id",
    "alpha",
    "acceptance_rate",
    "lessons",
    "updates",
    "train_s",
]


def digest(directory: str) -> str:
    return hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file())
    ).hexdigest()


def test_online_equals_the_greedy_baseline_while_its_draft_learns(untied_target, tiny_pair, prompts_file, tmp_path):
    out, saved, draft = tmp_path / "run", tmp_path / "learned", tiny_pair[1]
    before = digest(draft)
    result = cli(
        "run",
        "--target",
        untied_target,
        "--draft",
        draft,
        "--method",
        "speculative,online",
        "--k",
        "2",
        "--dataset",
        prompts_file,
        "--max-new-tokens",
        "24",
        "--cost-repeats",
        "2",
        "--online-every",
        "1",
        "--save-draft",
        str(saved),
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert (summary["outputs_match"] == 3).all()  # every prompt, though the draft changed after each
    online = pd.read_csv(out / "online.csv")
    assert list(online.columns) == ONLINE_COLUMNS and online["prompt_index"].tolist() == [0, 1, 2]
    assert (online["lessons"] > 0).all() and online["updates"].tolist() == [1, 2, 3]
    records = pd.read_csv(out / "records.csv")
    learning = records[records["method"] == "online"]
    assert learning["train_s"].tolist() == pytest.approx(online["train_s"].tolist()) and (learning["train_s"] > 0).all()
    assert records.loc[records["method"] == "speculative", "train_s"].isna().all()
    # Training time is reported apart from decoding, and the speedup with it is lower.
    row = summary.loc["online"]
    assert row["train_s"] == pytest.approx(learning["train_s"].sum())
    assert row["speedup_with_training"] < row["speedup"]
    assert row["options"].startswith("online_every=1,") and pd.isna(summary.loc["speculative", "train_s"])
    # The shipped draft is never changed; the learned one is written where asked, and differs.
    assert digest(draft) == before
    original, learned = (
        load(draft, torch.device("cpu"), torch.float32),
        load(str(saved), torch.device("cpu"), torch.float32),
    )
    weights = zip(original.model.state_dict().values(), learned.model.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in weights)
    assert json.loads((saved / "online.json").read_text())["updates"] == 3


@pytest.mark.slow
def test_a_draft_that_learns_from_a_repeated_prompt_accepts_more(untied_target, tiny_pair, tmp_path):
    # The same prompt six times: what the draft learns from one decode is exactly what the next asks.
    # Under greedy a frozen draft accepts the same on every repeat, so any rise is the updates' doing.
    data = tmp_path / "repeated.jsonl"
    data.write_text((json.dumps({"prompt": "def square(x):\n"}) + "\n") * 6)
    out = tmp_path / "run"
    result = cli(
        "run",
        "--target",
        untied_target,
        "--draft",
        tiny_pair[1],
        "--method",
        "speculative,online",
        "--k",
        "2",
        "--dataset",
        str(data),
        "--max-new-tokens",
        "24",
        "--cost-repeats",
        "2",
        "--online-lr",
        "0.01",
        "--online-steps",
        "8",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    records = pd.read_csv(out / "records.csv").sort_values("prompt_index")
    frozen = records.loc[records["method"] == "speculative", "alpha"].tolist()
    assert frozen == [frozen[0]] * 6
    alpha = pd.read_csv(out / "online.csv")["alpha"].tolist()
    assert alpha[0] == frozen[0]  # the first prompt is decoded before any update
    # Training on rejections alone also unlearns some accepted positions, so alpha moves unevenly:
    # judge the last three repeats together.
    assert sum(alpha[3:]) / 3 > alpha[0] + 0.3, alpha


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--save-draft", "somewhere"], "--save-draft is read only by --method online, not by --method speculative"),
        (["--method", "online", "--random-weights"], "--random-weights"),
        (["--method", "online", "--online-every", "0"], "--online-every"),
        (["--method", "online", "--resume"], "--resume cannot restore"),
        (["--method", "cascade", "--cascade-split", "-1"], "--cascade-split must be >= 0"),
    ],
)
def test_bad_online_and_cascade_options_are_one_clear_line(tiny_pair, prompts_file, tmp_path, args, needle):
    common = ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--dataset", prompts_file]
    one_line_error(cli("run", *common, "--out", str(tmp_path / "run"), *args), needle)


def test_a_cascade_split_beyond_k_is_refused_before_any_model_loads(tmp_path):
    from specbench.bench.config import BenchConfig

    missing = str(tmp_path / "no-model")  # never read: the options are refused first
    args = ["--method", "cascade", "--cascade-split", "9", "--k", "2", "--out", str(tmp_path / "run")]
    result = cli("run", "--target", missing, "--draft", missing, *args)
    one_line_error(result, "--cascade-split 9 is more than --k 2", "lower it")
    with pytest.raises(SpecbenchError, match="--cascade-split 3 is more than --k 2"):
        BenchConfig(methods=["cascade"], cascade_split=3, ks=[2, 4]).validate()  # every K of a sweep
    BenchConfig(methods=["cascade"], cascade_split=2, ks=[2, 4]).validate()  # M = K: lookup drafts none
