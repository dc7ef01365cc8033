"""What training data may not contain: the questions specbench evaluates on.

A drafter trained on Spec-Bench's or MT-Bench's questions (or on text that embeds them) would
measure well on exactly those questions and say nothing about the workload they stand for. The
check is by overlap of normalised text, as contamination checks of language-model training data
do: a training prompt is held out when it shares a run of ``SHINGLE`` words with a question turn,
or, for a turn shorter than that (Spec-Bench's qa questions are a dozen words), when it contains
the whole turn.

Spec-Bench's question file is not redistributed, so specbench ships fingerprints of it instead:
64-bit hashes of every short turn, of every shingle of a turn under LONG_TURN words, and of every
fourth shingle of a longer one (chosen by hash, so the same shingles are kept on every machine). A
verbatim copy of a long turn shares at least 28 shingles with it and is missed with probability
0.75**28 (0.03%). When the file itself is on the machine (where `--dataset spec-bench` reads it), every
shingle of it is checked as well. `make held-out-fingerprints` rewrites the shipped file from it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import numpy as np

from specbench.core.environment import cache_dir, config_dir
from specbench.core.errors import SpecbenchError
from specbench.workloads.prompts import read_dataset

SHINGLE = 13  # words: the run length GPT-3's and later contamination checks use
# A turn shorter than this is a generic follow-up ("Can you parallelize it?"), not a question a
# drafter could have memorised; Spec-Bench's qa questions start at 8 words.
MIN_WORDS = 8
KEEP_ONE_IN = 4  # of a long turn's shingles, those whose hash is 0 modulo this are shipped
LONG_TURN = 40  # words: every shingle of a shorter turn is shipped
FINGERPRINTS = "held_out/spec-bench.npy"  # under configs/
HELD_OUT_DATASETS = ("spec-bench", "mt-bench")  # MT-Bench's questions are Spec-Bench's first 80


def words(text: str) -> list[str]:
    """The text's words, lower-cased: punctuation, case and spacing do not hide a copy."""
    return re.findall(r"\w+", text.lower())


def fingerprint(run: list[str]) -> int:
    """A 64-bit hash of a run of words (stable across machines and Python versions)."""
    return int.from_bytes(hashlib.blake2b(" ".join(run).encode(), digest_size=8).digest(), "little")


def shingles(text: str) -> Iterable[int]:
    """The fingerprints of every run of SHINGLE consecutive words of ``text``."""
    w = words(text)
    return (fingerprint(w[i : i + SHINGLE]) for i in range(len(w) - SHINGLE + 1))


def turn_fingerprints(turns: Iterable[str], keep_one_in: int = 1) -> set[int]:
    """What a training prompt is checked against: each short turn's whole text and the shingles of
    every turn, of a turn of LONG_TURN words or more those with hash 0 modulo ``keep_one_in``."""
    found = set()
    for turn in turns:
        w = words(turn)
        if MIN_WORDS <= len(w) < SHINGLE:
            found.add(fingerprint(w))
        found.update(h for h in shingles(turn) if len(w) < LONG_TURN or h % keep_one_in == 0)
    return found


def overlaps(text: str, held: set[int]) -> bool:
    """Whether ``text`` shares a shingle with the held-out turns, or contains a whole turn of
    MIN_WORDS to SHINGLE - 1 words."""
    w = words(text)
    if any(h in held for h in shingles(text)):
        return True
    return any(fingerprint(w[i : i + n]) in held for n in range(MIN_WORDS, SHINGLE) for i in range(len(w) - n + 1))


def held_out_fingerprints() -> frozenset[int]:
    """The shipped fingerprints, with every shingle of the benchmark files found on this machine."""
    return _fingerprints_in(cache_dir())


@cache
def _fingerprints_in(cache_folder: Path) -> frozenset[int]:
    # cache_folder is only the key (read_dataset reads the folder itself): a process that points
    # SPECBENCH_CACHE elsewhere gets that folder's questions, not those read first.
    shipped = config_dir() / FINGERPRINTS
    held = set(np.load(shipped).tolist()) if shipped.is_file() else set()
    for name in HELD_OUT_DATASETS:
        try:
            prompts = read_dataset(name)
        except SpecbenchError:  # not on this machine: the shipped fingerprints stand for it
            continue
        held |= turn_fingerprints(t for p in prompts for t in p.turns)
    return frozenset(held)


def write_fingerprints(question_file: Path, out: Path | None = None) -> int:
    """Write the fingerprints specbench ships from Spec-Bench's question file; returns how many."""

    prompts = read_dataset(str(question_file))
    held = sorted(turn_fingerprints((t for p in prompts for t in p.turns), KEEP_ONE_IN))
    out = out or config_dir() / FINGERPRINTS
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, np.array(held, dtype=np.uint64))
    return len(held)
