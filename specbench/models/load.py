"""Loading the model a name means (models/names.py resolves the name), or a random-weight one: device
and dtype, placement, and tokenizer compatibility. The wrapper the decode loop drives is in models/lm.py."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specbench.core.environment import cache_dir, config_dir, hub_snapshot
from specbench.core.errors import SpecbenchError
from specbench.core.files import write_text
from specbench.core.options import DEFAULT_DRAFT, DEFAULT_TARGET
from specbench.models.names import ModelSource, alias_entry, resolve, speculator_dir, vocabulary

log = logging.getLogger("specbench")

HEAD_TOKENS = "head_tokens.json"  # written by `specbench distill` beside a draft's weights
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt")  # config, weights, tokenizer


def local_dir(source: ModelSource) -> Path:
    """A directory with config, weights and tokenizer for ``source``, downloading or converting once."""
    if source.kind == "dir":
        return Path(source.location)
    if source.kind == "gguf":
        return _converted_gguf(Path(source.location))
    return hub_snapshot(source.location, MODEL_FILES, "; --random-weights times the architecture without the weights")


REDOWNLOAD = "download it again (an interrupted download leaves a file cut short)"
SAFETENSORS_HEADER = 100_000_000  # the longest header safetensors reads


def weights_problem(path: Path) -> str | None:
    """Why the weights file ``path`` cannot be read, from its header and size alone (a safetensors file,
    or a PyTorch zip archive): cut short, corrupt, or not weights at all; None when it looks whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if path.suffix == ".bin":
            if head[:4] != b"PK\x03\x04":
                return None  # torch's legacy pickle format: nothing to check cheaply
            try:
                zipfile.ZipFile(f).close()
            except (zipfile.BadZipFile, OSError):
                return f"it holds {size:,} bytes that are not a whole zip archive (PyTorch's format)"
            return None
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or length > min(size - 8, SAFETENSORS_HEADER):
            return f"it holds {size:,} bytes, fewer than its header says it has: not a whole safetensors file"
        try:
            header = json.loads(f.read(length))
            ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"its header is not a safetensors header ({size:,} bytes): not a safetensors file"
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"it holds {size:,} bytes and its header lists {expected:,}"
    return None


def check_weights(directory: Path) -> None:
    """Refuse a checkpoint whose weights files cannot be read, in one line naming the file, before
    transformers reads them (its error would be a long traceback that names no file)."""
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    for file in files:
        if (why := weights_problem(file)) is not None:
            raise SpecbenchError(f"cannot read the weights file {file}: {why}; {REDOWNLOAD}")


def gguf_problem(gguf: Path) -> str | None:
    """Why ``gguf`` cannot be read as a GGUF file (cut short, corrupt, not a GGUF file), or None."""
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            return "it does not begin with GGUF's magic bytes: not a GGUF file"
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)
    except Exception:  # where the file breaks off, the reader fails in struct, numpy or value errors
        return f"the GGUF reader cannot read its {gguf.stat().st_size:,} bytes through: it is cut short or corrupt"
    return None


def _converted_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a float32 safetensors checkpoint under the user cache.

    transformers dequantises GGUF on every load (~30 s for SmolLM2-135M); the cached copy loads in
    about a second. The key is the file's content (its SHA-256, a tenth of a second for SmolLM2's 93 MB),
    so the same file installed in another virtualenv finds the copy, and a replaced one is converted again.
    """
    with open(gguf, "rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors once (about 30 s), cached in %s", gguf.name, out)
    # transformers draws a bar per tensor (tqdm, which ignores its progress-bar switch): a line per update
    # in a log, so it is shown on a terminal only.
    quiet = contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO())
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with quiet:
            quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        # A file that cannot be read fails in many ways inside the GGUF reader: said in one line, as is a
        # whole GGUF file that holds no model transformers can make (an adapter, a vision projector, an
        # architecture it does not convert). Anything else is raised as it is.
        if (why := gguf_problem(gguf)) is not None:
            raise SpecbenchError(f"cannot read the GGUF file {gguf}: {why}; {REDOWNLOAD}") from None
        if isinstance(e, (ValueError, KeyError, NotImplementedError)):
            raise SpecbenchError(
                f"cannot make a model of the GGUF file {gguf} ({str(e).splitlines()[0]}): give the GGUF of a "
                "language model transformers converts (Llama, Qwen, ...), or its checkpoint directory"
            ) from None
        raise
    config = quantised.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    staging = out.with_name(f"{out.name}.partial-{os.getpid()}")  # its own: another process may convert too
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(out)  # only a complete conversion ever appears under the final name
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(staging)  # another process finished first; its copy is the same
    return out


# ---------------------------------------------------------------- device, dtype, loading


def resolve_device(device: str) -> torch.device:
    if device != "auto":
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SpecbenchError(
                f"--device {device} asked for, but torch sees no CUDA device: use --device cpu or auto"
            )
        if device == "mps" and not torch.backends.mps.is_available():
            raise SpecbenchError(
                "--device mps asked for, but torch sees no MPS device (Apple silicon): use --device cpu or auto"
            )
        chosen = torch.device(device)
        if chosen.type == "cuda" and chosen.index is not None and chosen.index >= (count := torch.cuda.device_count()):
            raise SpecbenchError(
                f"--device {device} asked for, but torch sees {count} CUDA device{'s' if count > 1 else ''} "
                f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES narrows them): pick one of those"
            )
        return chosen
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda" and not native_bfloat16(device):
            log.info(
                "%s computes bfloat16 only by emulation (compute capability %d.%d, native from 8.0): --dtype auto "
                "uses float16",
                device,
                *torch.cuda.get_device_capability(device),
            )
            return torch.float16
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if dtype not in DTYPES:
        raise SpecbenchError(f"unknown --dtype {dtype}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def native_bfloat16(device: torch.device) -> bool:
    """Whether the CUDA ``device`` computes in bfloat16 natively: compute capability 8.0 (Ampere) and
    later, and every ROCm GPU. torch.cuda.is_bf16_supported() asks about the current device only, and
    counts the slow emulation on T4 and V100 as support."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


@dataclass
class LoadedModel:
    name: str
    path: Path  # the checkpoint directory (for random weights: the architecture's config.json)
    model: object  # a transformers PreTrainedModel
    tokenizer: object | None  # None for random weights
    head_tokens: torch.Tensor | None = None  # a distilled draft's vocabulary shortlist (head_tokens.json)

    @property
    def width(self) -> int:
        """Logit width (the embedding matrix may be padded beyond the tokenizer's size)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def context_window(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def stop_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, list) else [ids]  # a copy: the config's own list stays as it is
        if self.tokenizer is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(i for i in ids if i is not None)


GROUPED_SDPA = "TRANSFORMERS_SDPA_FORCE_GQA"


def use_grouped_attention(device: torch.device) -> None:
    """On CPU, let torch's SDPA attend with grouped key/value heads in multi-token forwards.

    For a forward with a mask (every verification) transformers otherwise repeats the key and
    value heads of a grouped-query model first: a copy of the whole cache in every layer, which
    made a 3-token forward of SmolLM2-135M cost 2.5 ms more (of 37). The logits are identical (a
    test checks). Not on CUDA, where a masked grouped call falls back to the slow math kernel.
    The variable is read at every call, so generate() and specbench's loop are affected alike.
    """
    if device.type == "cpu":
        os.environ.setdefault(GROUPED_SDPA, "1")


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's placement strategies


def load(spec: str, device: torch.device, dtype: torch.dtype, device_map: str | None = None) -> LoadedModel:
    """A checkpoint on ``device``, or with ``device_map`` spread by accelerate over the devices it sees."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    use_grouped_attention(device)
    from safetensors import SafetensorError

    source = resolve(spec)
    path = local_dir(source)
    check_weights(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        # Without a placement strategy, every weight is read straight onto the device: never the whole
        # model in host memory first (a 7B model in bfloat16 is 14 GB of RAM that a GPU box may not have).
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map or {"": device})
    except SafetensorError as e:  # a file whose header passed check_weights, and still could not be read
        raise SpecbenchError(
            f"cannot read the weights of model '{spec}' in {path} ({str(e).splitlines()[0]}); {REDOWNLOAD}"
        ) from None
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"cannot load model '{spec}' from {path}: {str(e).splitlines()[0]}") from e
    model.eval()
    shortlist = path / HEAD_TOKENS
    head_tokens = torch.tensor(json.loads(shortlist.read_text())) if shortlist.is_file() else None
    return LoadedModel(spec, path, model, tokenizer, head_tokens)


def placement(model) -> dict:
    """Where each module of ``model`` lives: accelerate's map when it spread the model over several
    devices, else the one device for all ("": device)."""
    return dict(getattr(model, "hf_device_map", None) or {"": str(model.device)})


def offload_warning(device_map: dict) -> str | None:
    """A device map that puts modules on the CPU or disk beside GPUs times those transfers too."""
    places = {str(place) for place in device_map.values()}
    offloaded = sorted(places & {"cpu", "disk"})
    if "disk" in places or (offloaded and places - {"cpu", "disk"}):
        return (
            f"the device map puts modules on {' and '.join(offloaded)}: its timings include moving weights to the "
            "GPU and are not GPU timings; give the target more GPU memory or a smaller dtype"
        )
    return None


# ---------------------------------------------------------------- random weights


def architecture(spec: str) -> Path:
    """The config.json giving ``spec``'s shape, for --random-weights: an alias's copy shipped in
    configs/ (for the alias or its hub id), a config.json file, a checkpoint directory, or a hub id in
    the local cache."""
    entry = alias_entry(spec)
    if "architecture" in entry:
        return config_dir() / entry["architecture"]
    path = Path(spec).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path.resolve()
    source = resolve(spec)
    if source.kind == "dir":
        return Path(source.location) / "config.json"
    if source.kind == "hub":
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(hf_hub_download(source.location, "config.json", local_files_only=True))
        except LocalEntryNotFoundError:
            pass
    raise SpecbenchError(
        f"no architecture config for '{spec}' on this machine: pass its config.json (from the model's hub page) "
        "as the model, e.g. --target path/to/config.json"
    )


def _skeleton(spec: str, dtype: torch.dtype):
    """The model with its parameters on the meta device (no memory, no initialisation); buffers are real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = architecture(spec)
    try:
        config = AutoConfig.from_pretrained(path)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise SpecbenchError(f"cannot build '{spec}' from {path}: {str(e).splitlines()[0]}") from None
    model.tie_weights()  # a tied output head is the embedding, not a second matrix
    return path, model


def weight_bytes(spec: str, dtype: torch.dtype) -> int:
    _, model = _skeleton(spec, dtype)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def available_memory() -> int | None:
    """Bytes of memory the kernel can give this process now (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def random_model(spec: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """``spec``'s architecture with random weights created on ``device`` in ``dtype``: forward costs
    depend on the shape, dtype and hardware, not on the weights. It has no tokenizer and never stops
    early (no end-of-sequence token)."""
    from accelerate.utils import set_module_tensor_to_device

    use_grouped_attention(device)
    path, model = _skeleton(spec, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if param.dim() > 1:
                value.normal_(0.0, std, generator=generator)
            else:  # normalisation scales are 1 and biases 0, as in a freshly initialised model
                value.fill_(0.0 if name.endswith("bias") else 1.0)
            set_module_tensor_to_device(model, name, device, value=value)
    model.tie_weights()  # the tied output head must share the embedding just created
    model.to(device).eval()
    model.generation_config.eos_token_id = None
    return LoadedModel(spec, path, model, None)


def skeleton(spec: str, random_weights: bool) -> LoadedModel:
    """``spec``'s configuration, shape and tokenizer without its weights (the model on the meta
    device): what a run needs when another engine (vLLM) loads the weights itself."""
    if random_weights:
        path, model = _skeleton(spec, torch.float32)
        model.generation_config.eos_token_id = None  # as random_model: it never stops early
        return LoadedModel(spec, path, model, None)
    path = local_dir(resolve(spec))
    _, model = _skeleton(str(path), torch.float32)
    return LoadedModel(spec, path, model, tokenizer_in(path))


def model_dir(model: LoadedModel) -> str:
    """The directory another engine loads ``model`` from. For random weights, a directory holding
    only its architecture's config.json (in specbench's cache), which vLLM fills with dummy weights."""
    if model.path.suffix != ".json":
        return str(model.path)
    text = model.path.read_text(encoding="utf-8")
    directory = cache_dir() / "architectures" / hashlib.sha256(text.encode()).hexdigest()[:12]
    if not (directory / "config.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        write_text(directory / "config.json", text)
    return str(directory)


def shared_width(target: LoadedModel, draft: LoadedModel) -> int | None:
    """Logit width both models share when their vocabularies agree; None when their tokenizers differ
    (only the methods that draft across vocabularies, drafters/vocab.py, take such a pair).

    Judged on vocabulary contents, never on vocab_size: models of one family pad their
    embeddings to different widths while sharing a tokenizer, and unrelated tokenizers can have
    equal sizes. Random-weight models have no tokenizer: their aliases must name one vocabulary
    (models.toml), or their vocabulary sizes must be equal.
    """
    if target.tokenizer is None or draft.tokenizer is None:
        sizes = target.model.config.vocab_size, draft.model.config.vocab_size
        family = vocabulary(target.name)
        if sizes[0] != sizes[1] and (family is None or family != vocabulary(draft.name)):
            raise SpecbenchError(
                f"{target.name} and {draft.name} have vocabularies of {sizes[0]} and {sizes[1]} tokens and no "
                "tokenizers to bridge them: a draft must share the target's tokenizer, or both must have one "
                "(with --random-weights: two aliases of one vocabulary in configs/models.toml)"
            )
        return min(target.width, draft.width)
    # Equal vocabularies, or the draft reads other ids: a draft whose vocabulary is the target's cut short
    # (or grown) would, over the shorter width, drop the target's other tokens from its law.
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        return None
    return min(target.width, draft.width)  # beyond their tokenizers, models pad their embeddings to other widths


@dataclass(frozen=True)
class Wanted:
    """What a run loads: the models as given (alias, hub id, directory or .gguf), where and how."""

    target: str
    draft: str | None  # None when no method needs the draft model
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None  # accelerate's placement over several devices
    random_weights: bool = False
    seed: int = 0  # of random weights
    weights: bool = True  # False: shapes, configs and tokenizers only (another engine loads the weights)
    speculator: str | None = None  # the --speculator head (alias or directory) when an EAGLE method decodes here


@dataclass
class Loaded:
    """The loaded models: the target, the draft (or None), the logit width they share, and where;
    the --speculator head's checkpoint directory; the tokenizer that encodes the prompts."""

    target: LoadedModel
    draft: LoadedModel | None
    width: int
    device: torch.device
    dtype: torch.dtype
    speculator: Path | None = None
    # The target's tokenizer; for random weights the one that measures prompt lengths (length_tokenizer),
    # None when there is none (then --prompt-tokens must give the lengths).
    prompt_tokenizer: object | None = None
    vocabularies_differ: bool = False  # the draft has a tokenizer of its own (drafters/vocab.py)


def load_models(wanted: Wanted) -> Loaded:
    """Load what ``wanted`` says, each model checked (a draft shares the target's vocabulary), and
    find the --speculator head's directory."""
    device = resolve_device(wanted.device)
    dtype = random_weights_dtype(wanted, device) if wanted.random_weights else resolve_dtype(wanted.dtype, device)
    speculator = speculator_dir(wanted.speculator) if wanted.speculator else None
    if not wanted.weights:
        device = torch.device("cpu")
        target = skeleton(wanted.target, wanted.random_weights)
        draft = skeleton(wanted.draft, wanted.random_weights) if wanted.draft else None
    elif wanted.random_weights:
        target = random_model(wanted.target, device, dtype, wanted.seed)
        draft = random_model(wanted.draft, device, dtype, wanted.seed + 1) if wanted.draft else None
    else:
        target = load(wanted.target, device, dtype, wanted.device_map)
        if wanted.device_map and (warning := offload_warning(placement(target.model))):
            log.warning(warning)
        draft = load(wanted.draft, device, dtype) if wanted.draft else None
    width = shared_width(target, draft) if draft else target.width
    tokenizer = length_tokenizer(target) if wanted.random_weights else target.tokenizer
    return Loaded(target, draft, width or target.width, device, dtype, speculator, tokenizer, width is None)


def length_tokenizer(target: LoadedModel):
    """The tokenizer that measures prompt lengths for a random-weights target: its own when one lies
    beside its architecture config, else the default target's (shipped with the bundled draft), else None."""
    for directory in (target.path.parent, Path(resolve(DEFAULT_DRAFT).location)):
        if (tokenizer := tokenizer_in(directory)) is None:
            continue
        if directory != target.path.parent:
            log.info("prompt lengths measured with %s's tokenizer (%s has none here)", DEFAULT_TARGET, target.name)
        return tokenizer
    return None


def random_weights_dtype(wanted: Wanted, device: torch.device) -> torch.dtype:
    """The dtype for random weights: as --dtype says, except that auto on the CPU falls back to
    bfloat16 when float32 weights would not fit in memory; a dtype that cannot fit is refused."""
    dtype = resolve_dtype(wanted.dtype, device)
    free = available_memory() if device.type == "cpu" else None
    if free is None:
        return dtype
    specs = [wanted.target] + ([wanted.draft] if wanted.draft else [])
    need = sum(weight_bytes(spec, dtype) for spec in specs)
    if need > 0.9 * free and wanted.dtype == "auto" and dtype.itemsize > 2:
        log.info("float32 weights need %.1f GB of the %.1f GB free: using bfloat16", need / 1e9, free / 1e9)
        dtype, need = torch.bfloat16, need // 2
    if need > 0.9 * free:
        raise SpecbenchError(
            f"the weights need {need / 1e9:.1f} GB in {str(dtype).removeprefix('torch.')} and {free / 1e9:.1f} GB "
            "of memory are free: use --dtype bfloat16 or a smaller model"
        )
    return dtype


def tokenizer_in(directory: Path):
    """The tokenizer saved in ``directory``, or None when it holds none (transformers 5.0 then tries a
    slow tokenizer from the config alone, and raises ImportError where sentencepiece's needs are missing)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, ImportError):
        return None
