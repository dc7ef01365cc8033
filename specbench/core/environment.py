"""What this machine offers specbench: the package's configs/, the user cache, whether the Hugging
Face hub answers, and a hub repository's files (from the local cache, else downloaded once)."""

from __future__ import annotations

import logging
import os
import socket
import tomllib
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

from specbench.core.errors import SpecbenchError

log = logging.getLogger("specbench")

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


def hub_snapshot(repo: str, files: tuple[str, ...], offline_hint: str = "") -> Path:
    """The directory of hub repository ``repo``: its snapshot in the local Hugging Face cache, else
    ``files`` (glob patterns) downloaded once. What keeps it from being had (offline and uncached,
    gated, not found, a download that broke) is one line; ``offline_hint`` ends the offline one."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if not hub_reachable():
        raise SpecbenchError(
            f"model {repo} is not in the local Hugging Face cache and the hub is unreachable: "
            f"download it where there is a network (`hf download {repo}`) and copy the cache "
            f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}) here, or pass a local directory{offline_hint}"
        )
    log.info("downloading %s from the hub", repo)
    try:
        return Path(snapshot_download(repo, allow_patterns=list(files)))
    except GatedRepoError:  # before its parent class: the hub answers a gated repo without access with both
        raise SpecbenchError(
            f"model {repo} is gated on the Hugging Face hub: accept its terms on https://huggingface.co/{repo} "
            "with your account, then log in (`hf auth login`) or set HF_TOKEN; or pass a local directory"
        ) from None
    except RepositoryNotFoundError:
        raise SpecbenchError(
            f"model {repo} is not on the Hugging Face hub, or is private: check the name, log in "
            "(`hf auth login`) or set HF_TOKEN for a private one, or pass a local directory"
        ) from None
    except OSError as e:  # the hub's other HTTP errors, a dropped connection, a full disk
        raise SpecbenchError(
            f"downloading model {repo} from the hub failed ({str(e).splitlines()[0]}): try again, or "
            "pass a local directory"
        ) from None
