"""What this machine offers specbench: the package's configs/, the user cache, and whether the
Hugging Face hub answers."""

from __future__ import annotations

import os
import socket
import tomllib
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

PACKAGE = Path(__file__).resolve().parent.parent  # specbench/: configs/ (in a wheel) and drafts/ sit in it


def config_dir() -> Path:
    """configs/ ships inside the wheel; in a source checkout it sits beside the package."""
    packaged = PACKAGE / "configs"
    return packaged if packaged.is_dir() else PACKAGE.parent / "configs"


def read_config(name: str) -> dict:
    with open(config_dir() / name, "rb") as f:
        return tomllib.load(f)


def cache_dir() -> Path:
    root = os.environ.get("SPECBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specbench"
    )
    return Path(root)


@cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect, so an offline machine is told in seconds rather than after retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False
