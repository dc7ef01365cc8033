"""Choosing how models load: the dtype --dtype auto picks on each device, and a hub model that cannot
be had (gated, missing) as one line naming the model and the fix."""

import logging
import sys

import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import load, resolve_dtype

CUDA = torch.device("cuda", 1)


def gpu_of_capability(monkeypatch, major: int, minor: int) -> list:
    """torch answering for a GPU of that compute capability, without one; returns the devices asked about."""
    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (major, minor))
    return asked


def test_auto_picks_float16_where_the_gpu_has_no_native_bfloat16(monkeypatch, caplog):
    asked = gpu_of_capability(monkeypatch, 7, 5)  # a T4
    with caplog.at_level(logging.INFO, logger="specbench"):
        assert resolve_dtype("auto", CUDA) == torch.float16
    assert asked and all(device == CUDA for device in asked)  # the run's GPU, not the current one
    [line] = [r.getMessage() for r in caplog.records]
    assert "cuda:1" in line and "7.5" in line and "float16" in line
    assert resolve_dtype("bfloat16", CUDA) == torch.bfloat16  # asked for by name: as asked


def test_auto_picks_bfloat16_on_an_ampere_gpu_and_float32_on_the_cpu(monkeypatch, caplog):
    gpu_of_capability(monkeypatch, 8, 0)
    with caplog.at_level(logging.INFO, logger="specbench"):
        assert resolve_dtype("auto", CUDA) == torch.bfloat16
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert not caplog.records


def hub_error(cls, message: str):
    """``cls`` as huggingface_hub raises it: with a response of the HTTP client it uses."""
    from huggingface_hub import errors

    client = sys.modules[errors.Response.__module__.split(".")[0]]
    request = client.Request("GET", "https://huggingface.co/api/models/org/name")
    return cls(message, response=errors.Response(401, request=request))


@pytest.mark.parametrize(
    "error, needles",
    [
        ("GatedRepoError", ["org/llama-gated is gated", "hf auth login", "HF_TOKEN", "huggingface.co/org/llama-gated"]),
        ("RepositoryNotFoundError", ["org/llama-gated is not on the Hugging Face hub", "check the name", "HF_TOKEN"]),
    ],
)
def test_a_hub_model_that_cannot_be_had_is_one_line(monkeypatch, error, needles):
    import huggingface_hub
    from huggingface_hub import errors

    def snapshot_download(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise errors.LocalEntryNotFoundError(f"{repo_id} is not in the cache")
        raise hub_error(getattr(errors, error), f"401 Client Error for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("specbench.models.load.hub_reachable", lambda: True)
    with pytest.raises(SpecbenchError) as raised:
        load("org/llama-gated", torch.device("cpu"), torch.float32)
    said = str(raised.value)
    assert "\n" not in said and all(needle in said for needle in needles), said
