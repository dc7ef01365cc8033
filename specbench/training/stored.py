"""What ``specbench distill`` keeps in --out for a later run to resume on, and the settings it was made
with: a run resumes on the teacher's labels, the target's answers and features, a draft's own tokenizer
and the training state only with the settings that decided their content (check_stored), which each
run records in --out as it starts (record_settings)."""

from __future__ import annotations

import json
from pathlib import Path

from specbench.core.errors import SpecbenchError
from specbench.core.files import replacing

FEATURES = "features"  # a head's run stores the target's features of each shard under this folder
TOKENIZER_DIR = "tokenizer"  # under --out: a draft's own tokenizer (distill_own_tokenizer), kept for a resumed run
SETTINGS = "stored.json"  # under --out: the settings that decide what it keeps for a resumed run (check_stored)
# What decides the content of the data a run keeps in --out and a later run resumes on: the teacher's
# labels of --source, the target's answers, and (both) the target's features of them.
LABELS = ("target", "sources", "seed", "top_k", "seq_len", "teacher_tokens")
ANSWERS = ("target", "sources", "seed", "top_k", "data", "generate_prompts", "max_prompt_tokens",
           "generate_new_tokens", "generate_batch", "sampled_fraction", "answers_from")  # fmt: skip
# Settings that change how fast a run goes but nothing it stores; and --epochs, which a resumed run may
# raise to go on training. Every other setting decides train_state.pt and a draft's own tokenizer.
FREE = ("out", "teacher_batch", "teacher_engine", "teacher_gguf", "llama_server", "save_every", "eval_every", "epochs")


def stored_settings(recipe: dict, names) -> dict:
    """The settings of a recipe (a DistillConfig's fields, or distill.json) among ``names`` that decide
    what distill keeps in --out (all but FREE), as JSON holds them, with the paths among them resolved: one model or
    directory named two ways is the same, and one relative name run from two places is not."""

    def resolved(name: str) -> str:
        path = Path(name).expanduser()
        return str(path.resolve()) if path.exists() else name

    settings = {k: v for k, v in recipe.items() if k in names and k not in FREE}
    for key in ("sources", "answers_from"):
        if key in settings:
            settings[key] = [resolved(str(name)) for name in settings[key]]
    if "target" in settings:
        settings["target"] = resolved(settings["target"])
    return json.loads(json.dumps(settings))  # tuples and lists compare alike after a round trip


def check_stored(out: Path, fields: dict) -> None:
    """Refuse a run whose settings (``fields``, a DistillConfig's) differ from those the data, features,
    tokenizer or training state already in ``out`` were made with: it would resume on them as if they were
    its own (a teacher's labels of another target or --seq-len trained on, a training state of another
    recipe gone on with).

    A run records its settings in SETTINGS as it starts (record_settings); a finished run from before
    that recorded them in distill.json, whose data settings are read instead."""
    trained = tuple(k for k in fields if k not in FREE)
    kept = (
        ("teacher", "the target's labels of --source", LABELS),
        ("generated", "the target's answers", ANSWERS),
        (FEATURES, "the target's features", LABELS + ANSWERS),
        (TOKENIZER_DIR, "the draft's own tokenizer", trained),
        ("train_state.pt", "a training state", trained),
    )
    now, record, finished = stored_settings(fields, fields), out / SETTINGS, out / "distill.json"
    before = None
    if record.is_file():
        before = json.loads(record.read_text())
    elif finished.is_file():  # distill.json records a trained draft's own shape and shortlist: only the data's
        # ... and --top-k as clamped to the target's vocabulary, which the command as given may exceed
        data = tuple(k for k in LABELS + ANSWERS if k != "top_k")
        before = stored_settings(json.loads(finished.read_text()), data)
    for name, what, keys in kept:
        path = out / name
        if not (path.is_file() or any(p.is_file() for p in path.rglob("*"))):
            continue
        if before is None:
            raise SpecbenchError(
                f"--out {out} holds {what} ({name}) but no record of the settings they were made with: "
                f"give another --out, or remove {path} to make it afresh"
            )
        changed = [k for k in keys if k in before and before[k] != now[k]]
        if changed:
            flags = {"sources": "--source"}
            was = ", ".join(f"{flags.get(k, '--' + k.replace('_', '-'))} {before[k]} -> {now[k]}" for k in changed)
            raise SpecbenchError(
                f"--out {out} holds {what} ({name}) made with other settings ({was}): run with those settings, "
                f"give another --out, or remove {path} to make it afresh"
            )


def record_settings(out: Path, fields: dict) -> None:
    """Record the settings (``fields``, a DistillConfig's) a run starts with in ``out``: check_stored has
    found them those of whatever it holds."""
    with replacing(out / SETTINGS) as tmp:
        tmp.write_text(json.dumps(stored_settings(fields, fields), indent=2) + "\n")
