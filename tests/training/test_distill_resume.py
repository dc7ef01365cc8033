"""``specbench distill``: options that would fail only once their phase is reached (minutes in) are
refused up front, in one line, before the target loads."""

import pytest

from ..helpers import cli, one_line_error


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
