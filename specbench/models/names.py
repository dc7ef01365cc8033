"""What a model name means, without loading anything (and without torch, so that the command line
checks names fast): an alias of models.toml, a local checkpoint directory, a .gguf file or a hub id;
and the EAGLE heads that models.toml names. Loading is models/load.py's."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from specbench.core.environment import PACKAGE, hub_snapshot, read_config
from specbench.core.errors import SpecbenchError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HEAD_FILES = ("*.json", "*.safetensors", "pytorch_model.bin")  # an EAGLE head: config, weights (some PyTorch's)


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user typed
    kind: str  # "dir", "gguf" or "hub"
    location: str  # directory, .gguf path, or hub id


def resolve(spec: str) -> ModelSource:
    """Turn an alias, a local directory, a .gguf file or a hub id into a concrete source."""
    aliases = read_config("models.toml")
    if spec in aliases:
        entry = aliases[spec]
        if "hub" in entry:
            return ModelSource(spec, "hub", entry["hub"])
        if "bundled" in entry:
            bundled = PACKAGE / entry["bundled"]
            if not (bundled / "config.json").is_file():
                raise SpecbenchError(f"bundled model '{spec}' is missing from {bundled}: reinstall specbench")
            return ModelSource(spec, "dir", str(bundled))
        found = importlib.util.find_spec(entry["package"])
        if found is None or found.origin is None:
            raise SpecbenchError(
                f"model '{spec}' comes from the Python package {entry['package']}, which is not installed: "
                f"run `{entry['install']}`"
            )
        return ModelSource(spec, "gguf", str(Path(found.origin).parent / entry["file"]))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SpecbenchError(f"GGUF file not found: {spec}: check the path")
        return ModelSource(spec, "gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecbenchError(
                f"'{spec}' is a directory without config.json: point at a saved transformers checkpoint"
            )
        return ModelSource(spec, "dir", str(path.resolve()))
    if HUB_ID.match(spec):
        return ModelSource(spec, "hub", spec)
    known = ", ".join(sorted(aliases))
    raise SpecbenchError(
        f"unknown model '{spec}': use an alias ({known}), a local checkpoint directory, a .gguf file or a hub id like org/name"
    )


def default_speculator(target: str) -> str | None:
    """The EAGLE head models.toml names for the alias ``target`` (its ``speculator``), if any."""
    return read_config("models.toml").get(target, {}).get("speculator")


def alias_entry(spec: str) -> dict:
    """models.toml's entry for ``spec``: the alias's own, or that of the alias whose hub id ``spec`` is
    (so --random-weights --target JackFram/llama-68m takes llama-68m's shipped architecture); {} for others."""
    aliases = read_config("models.toml")
    return aliases.get(spec) or next((entry for entry in aliases.values() if entry.get("hub") == spec), {})


def vocabulary(spec: str) -> str | None:
    """The tokenizer models.toml says the alias ``spec`` (or its hub id) was trained with (its
    ``vocabulary``), if any: what tells two random-weight models of one family apart from unrelated ones,
    as they load without tokenizers and their families pad their embeddings to other widths."""
    return alias_entry(spec).get("vocabulary")


def speculator_dir(spec: str) -> Path:
    """The checkpoint directory of an EAGLE head given as an alias (a bundled head), a directory or a
    hub id (from the local cache, else its HEAD_FILES downloaded once, as a --target's)."""
    bundled = "bundled" in read_config("models.toml").get(spec, {})
    path = Path(resolve(spec).location) if bundled else Path(spec).expanduser()
    if not path.is_dir() and HUB_ID.match(spec) and not path.parent.is_dir():  # heads/mine, mistyped: a path
        return hub_snapshot(spec, HEAD_FILES)
    if not path.is_dir():
        raise SpecbenchError(
            f"--speculator {spec}: no such directory; give an EAGLE-3 head's checkpoint directory, a head's alias "
            "or its hub id"
        )
    return path
