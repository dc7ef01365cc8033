"""What a run's timings depend on besides the code: the machine and the software (meta.json)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import torch
import transformers

from specbench import __version__


def machine(gpu: str | None) -> dict:
    """What an absolute throughput depends on besides the code: compare judges tokens/s only between
    runs whose fingerprints are equal. A run on a GPU (``gpu``, its name) adds the CUDA version torch
    was built with and the driver's; a CPU run's keys stay those of the committed baselines, or none
    of them would be judged again."""
    cpu = platform.processor()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):  # not Linux, or an architecture whose cpuinfo names no model
        pass
    fingerprint = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if gpu is not None:
        fingerprint |= {"cuda": torch.version.cuda, "driver": driver_version()}
    return fingerprint


def driver_version() -> str | None:
    """The NVIDIA driver's version: from pynvml where it is installed, else from nvidia-smi, else None."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                version = pynvml.nvmlSystemGetDriverVersion()
            finally:
                pynvml.nvmlShutdown()
            return version.decode() if isinstance(version, bytes) else version  # bytes from older pynvml
        except pynvml.NVMLError:
            pass
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = answer.stdout.split()  # a line per GPU, all the one driver's
    return lines[0] if answer.returncode == 0 and lines else None


def machine_slug(fingerprint: dict) -> str:
    """A directory name for a machine's baseline: its CPU (or GPU), cores and torch threads."""
    name = f"{fingerprint['gpu'] or fingerprint['cpu']}-{fingerprint['cores']}-cores-{fingerprint['torch_threads']}-threads"
    return re.sub(r"[^a-z0-9.]+", "-", name.lower().replace("(r)", "").replace("(tm)", "")).strip("-")


def _git(where: Path, *args: str) -> str | None:
    """What git prints for ``args`` in the folder ``where``; None outside a checkout, or without git."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=where, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_revision(where: Path = Path(__file__).parent) -> tuple[str | None, int | None]:
    """The commit of the checkout holding ``where`` (specbench's own by default), and how many of its
    tracked files differ from it: a run of uncommitted code (or of a working tree copied over an older
    repository, as a device machine receives it) is not that commit's run, and its record says so.
    (None, None) outside a checkout."""
    commit = (_git(where, "rev-parse", "HEAD") or "").strip() or None
    status = _git(where, "--no-optional-locks", "status", "--porcelain", "--untracked-files=no") if commit else None
    return commit, None if status is None else len(status.splitlines())


def environment(device) -> dict:
    """meta.json's description of the software and machine of a run on the torch device ``device``."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    fingerprint = machine(gpu)
    commit, changed = source_revision()
    return {
        "specbench": __version__,
        "python": platform.python_version(),
        "torch": fingerprint["torch"],
        "transformers": fingerprint["transformers"],
        "platform": platform.platform(),
        "device_name": gpu or device.type,
        "torch_threads": fingerprint["torch_threads"],
        "sdpa_force_gqa": os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"),
        "git_commit": commit,
        "git_changed_files": changed,
        "machine": fingerprint,
    }
