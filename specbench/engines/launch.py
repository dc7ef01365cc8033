"""Servers that specbench starts itself (--launch NAME=COMMAND): on loopback, a free port, waited
for, logged and stopped.

The command is the user's (a vLLM, SGLang, llama.cpp or TensorRT-LLM server), with ``{port}`` where
the port goes; it runs in a process group of its own with its output in ``{log_dir}/NAME.log``, is
given ``WAIT_S`` to answer /health (or /v1/models), and is stopped with SIGTERM, then SIGKILL, on
exit. The tests start their real servers this way.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specbench.core.errors import SpecbenchError

WAIT_S = 600.0  # a large model's load on a GPU server takes minutes
STOP_S = 30.0
# How often a launched server's health is asked while it starts. A llama-server of a small model
# answers a second or two after it starts, and every run with --launch waits on one per server, so
# a second's poll (half a second lost a launch, on average) added up; a poll costs a starting
# server next to nothing (a refused connection, or a 503 while it loads).
POLL_S = 0.2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(root: str) -> bool:
    """Whether the server at ``root`` answers its health check (or lists its models)."""
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(root + path, timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return False


@contextmanager
def launched(
    name: str, command: str, log_dir: Path, wait_s: float = WAIT_S, port: int | None = None, who: str = ""
) -> Iterator[str]:
    """Start ``command`` (``{port}`` filled in: ``port``, or a free one), wait until it answers, yield
    its API URL (http://127.0.0.1:PORT/v1); stop it on exit. One line naming its log when it exits or
    does not answer in ``wait_s``; ``who`` starts that line (default: --launch NAME)."""
    who = who or f"--launch {name}"
    if "{port}" not in command:
        raise SpecbenchError(f"--launch {name}=...: put {{port}} where the server's port goes, e.g. --port {{port}}")
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    argv = shlex.split(command.replace("{port}", str(port)))
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise SpecbenchError(f"{who}: cannot start {argv[0]} ({e.strerror or e})") from None
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while not ready(root):
            if process.poll() is not None:
                raise SpecbenchError(f"{who}: the server exited with code {process.returncode}: see {log_path}")
            if time.monotonic() > deadline:
                raise SpecbenchError(f"{who}: the server did not answer in {wait_s:g} s: see {log_path}")
            time.sleep(POLL_S)
        yield root + "/v1"
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after STOP_S."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
