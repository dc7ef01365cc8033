"""Choosing how models load: the dtype --dtype auto picks on each device."""

import logging

import torch

from specbench import models

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
        assert models.resolve_dtype("auto", CUDA) == torch.float16
    assert asked and all(device == CUDA for device in asked)  # the run's GPU, not the current one
    [line] = [r.getMessage() for r in caplog.records]
    assert "cuda:1" in line and "7.5" in line and "float16" in line
    assert models.resolve_dtype("bfloat16", CUDA) == torch.bfloat16  # asked for by name: as asked


def test_auto_picks_bfloat16_on_an_ampere_gpu_and_float32_on_the_cpu(monkeypatch, caplog):
    gpu_of_capability(monkeypatch, 8, 0)
    with caplog.at_level(logging.INFO, logger="specbench"):
        assert models.resolve_dtype("auto", CUDA) == torch.bfloat16
        assert models.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert not caplog.records
