"""The suite runs on the CPU on a GPU runner too, but for the tests marked gpu (conftest.on_the_cpu)."""

import os
import subprocess
import sys

import pytest
import torch


def test_a_test_not_marked_gpu_sees_no_gpu_in_process_or_in_the_cli():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""  # inherited by every CLI subprocess
    assert not torch.cuda.is_available()
    seen = subprocess.run(
        [sys.executable, "-c", "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seen.stdout.strip() == "''"


@pytest.mark.gpu
def test_a_test_marked_gpu_sees_the_gpu():
    assert torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
