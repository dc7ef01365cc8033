"""Everything that knows transformers: resolving a model name, loading it, device and dtype,
tokenizer compatibility, and the KV-cache wrapper the engine drives."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

import tomllib
import torch

from .errors import SpecbenchError
from .kv import SINKS, retrieval_positions, window_positions
from .timing import ForwardLaps

log = logging.getLogger("specbench")

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HEAD_TOKENS = "head_tokens.json"  # written by `specbench distill` beside a draft's weights
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dir() -> Path:
    """configs/ ships inside the wheel; in a source checkout it sits beside the package."""
    packaged = Path(__file__).parent / "configs"
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "configs"


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


# ---------------------------------------------------------------- resolving a name


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
            bundled = Path(__file__).parent / entry["bundled"]
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


def local_dir(source: ModelSource) -> Path:
    """A directory with config, weights and tokenizer for ``source``, downloading or converting once."""
    if source.kind == "dir":
        return Path(source.location)
    if source.kind == "gguf":
        return _converted_gguf(Path(source.location))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source.location, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if not hub_reachable():
        raise SpecbenchError(
            f"model {source.location} is not in the local Hugging Face cache and the hub is unreachable: "
            f"download it where there is a network (`hf download {source.location}`) and copy the cache "
            f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}) here, or pass a local directory; "
            "--random-weights times the architecture without the weights"
        )
    log.info("downloading %s from the hub", source.location)
    return Path(snapshot_download(source.location, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def _converted_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a float32 safetensors checkpoint under the user cache.

    transformers dequantises GGUF on every load (~30 s for SmolLM2-135M); the cached copy loads in
    about a second. The key includes size and mtime so a replaced file is converted again.
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors once (about 30 s), cached in %s", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if dtype not in DTYPES:
        raise SpecbenchError(f"unknown --dtype {dtype}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


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
    source = resolve(spec)
    path = local_dir(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"cannot load model '{spec}' from {path}: {str(e).splitlines()[0]}") from e
    if device_map is None:
        model.to(device)
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
    configs/, a config.json file, a checkpoint directory, or a hub id in the local cache."""
    entry = read_config("models.toml").get(spec, {})
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


def shared_width(target: LoadedModel, draft: LoadedModel) -> int:
    """Logit width both models share, after checking that their vocabularies agree.

    Judged on vocabulary contents, never on vocab_size: models of one family pad their
    embeddings to different widths while sharing a tokenizer, and unrelated tokenizers can have
    equal sizes. Random-weight models have no tokenizer: their vocabulary sizes must be equal.
    """
    if target.tokenizer is None or draft.tokenizer is None:
        sizes = target.model.config.vocab_size, draft.model.config.vocab_size
        if sizes[0] != sizes[1]:
            raise SpecbenchError(
                f"{target.name} and {draft.name} have vocabularies of {sizes[0]} and {sizes[1]} tokens: "
                "a draft must share the target's tokenizer"
            )
        return min(target.width, draft.width)
    t_vocab = {i: s for s, i in target.tokenizer.get_vocab().items()}
    d_vocab = {i: s for s, i in draft.tokenizer.get_vocab().items()}
    # Ids past the smaller vocabulary are tokens one side added at the end (padding, specials).
    for i in range(min(len(t_vocab), len(d_vocab))):
        if t_vocab.get(i) != d_vocab.get(i):
            raise SpecbenchError(
                f"tokenizers of {target.name} and {draft.name} differ (id {i} is {t_vocab.get(i)!r} vs "
                f"{d_vocab.get(i)!r}): speculative decoding needs a draft with the target's tokenizer"
            )
    width = min(target.width, draft.width)
    return width


@cache
def growing_layer():
    """transformers' DynamicLayer, appending in place: keys and values are views of buffers with room
    to spare, reallocated a quarter larger only when full. DynamicLayer concatenates, copying the
    whole cache at every forward: at 8k tokens of SmolLM2-135M on a CPU, a fifth of a step."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            length, n = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
            # keys and values may have been cut (crop) or replaced (a window's eviction) since the last update
            held = self.buffers is not None and self.keys.data_ptr() == self.buffers[0].data_ptr()
            if not held or length + n > self.buffers[0].shape[-2]:
                room = length + n + max(256, (length + n) // 4)
                self.buffers = tuple(
                    self._grown(old, new, length, room)
                    for old, new in ((self.keys, key_states), (self.values, value_states))
                )
            for buffer, new in zip(self.buffers, (key_states, value_states), strict=True):
                buffer[:, :, length : length + n] = new
            self.keys, self.values = (buffer[:, :, : length + n] for buffer in self.buffers)
            return self.keys, self.values

        @staticmethod
        def _grown(old: torch.Tensor, new: torch.Tensor, length: int, room: int) -> torch.Tensor:
            buffer = new.new_empty(*new.shape[:2], room, new.shape[-1])
            if length:
                buffer[:, :, :length] = old
            return buffer

    return GrowingLayer


class HFCausalLM:
    """A transformers model with its own DynamicCache, speaking the engine's protocol.

    With ``head_tokens`` the vocabulary projection covers only those ids plus every id the
    model has read since ``reset`` (so identifiers in the prompt stay predictable); the rest get
    logit -inf. For a small draft the full projection is most of a forward's cost. Verification
    stays exact: drafts come from, and are judged against, this restricted distribution.
    """

    prefill_chunk = 0  # a plain forward over more tokens than this runs in chunks of it (0: whole)
    progress: Callable[[int, int], None] | None = None  # told (tokens done, tokens) after each chunk

    def __init__(self, model, width: int, head_tokens: torch.Tensor | None = None):
        self.model = model
        self.width = width  # logits beyond the shared width are dropped so p and q align
        self.device = model.device
        self.queries: list[torch.Tensor] | None = None  # see watch_queries
        self.head_tokens = None if head_tokens is None else head_tokens[head_tokens < width].to(self.device)
        if self.head_tokens is not None:  # gathered once; reset() returns to these without copying
            self.shortlist_mask = torch.zeros(width, dtype=torch.bool, device=self.device)
            self.shortlist_mask[self.head_tokens] = True
            self.shortlist_head = self.model.get_output_embeddings().weight[self.head_tokens]
        self.reset()

    def refresh(self, more_tokens: torch.Tensor) -> None:
        """After the weights changed (online updates): gather the shortlisted head again from them,
        with ``more_tokens`` added to the shortlist. Takes effect at the next ``reset``."""
        if self.head_tokens is None:
            return  # the full projection reads the weights themselves
        more = more_tokens.to(self.device)
        more = more[(more < self.width) & ~self.shortlist_mask[more.clamp(max=self.width - 1)]].unique()
        self.head_tokens = torch.cat([self.head_tokens, more])
        self.shortlist_mask[more] = True
        self.shortlist_head = self.model.get_output_embeddings().weight[self.head_tokens].detach()

    def reset(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.cache = DynamicCache(config=self.model.config)
        grow = growing_layer()
        self.cache.layers = [grow() if type(layer) is DynamicLayer else layer for layer in self.cache.layers]
        if self.head_tokens is not None:
            self.in_head = self.shortlist_mask.clone()
            self.head_ids, self.head = self.head_tokens, self.shortlist_head  # _read replaces, never mutates, them

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def _read(self, token_ids: torch.Tensor) -> None:
        """Add ids the model reads to the shortlist."""
        unseen = ~self.in_head[token_ids]
        if unseen.any():  # rarely, once the prompt is read: one cheap test rather than a unique() per forward
            new = token_ids[unseen].unique()
            self.in_head[new] = True
            self.head_ids = torch.cat([self.head_ids, new])
            self.head = torch.cat([self.head, self.model.get_output_embeddings().weight[new]])

    def _inputs(self, token_ids: torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor | None) -> dict:
        """Keyword arguments of the model call; without positions and mask, exactly the linear decode's."""
        inputs = {"input_ids": token_ids.view(1, -1), "past_key_values": self.cache, "use_cache": True}
        if positions is None and mask is None:
            return inputs
        n, past = token_ids.shape[0], self.cache.get_seq_length()
        if positions is None:
            positions = torch.arange(past, past + n, device=self.device)
        inputs["position_ids"] = positions.to(self.device).view(1, -1)  # transformers feeds these to RoPE as given
        if mask is not None:
            if mask.shape != (n, past + n):
                raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({n}, {past + n})")
            # A 4D mask reaches attention untouched. Additive and in the model's dtype, because eager
            # attention adds it to the scores (a bool would be added as 0/1); sdpa accepts it as well.
            dtype = self.model.dtype
            additive = torch.zeros(mask.shape, dtype=dtype, device=self.device)
            inputs["attention_mask"] = additive.masked_fill_(~mask.to(self.device), torch.finfo(dtype).min)[None, None]
        return inputs

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """Start a new sequence with the prompt."""
        self.reset()
        self.forward(prompt_ids, last=1)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        last: int = 1,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n, chunk = len(token_ids), self.prefill_chunk
        if positions is not None or mask is not None or not chunk or n <= chunk:
            return self._forward(token_ids, last, positions, mask)
        # A long prompt in chunks: attention's memory grows with chunk x context, not context^2.
        tail = max(last, n - (n - 1) // chunk * chunk)  # the final chunk, which yields the logits
        for start in range(0, n - tail, chunk):
            self._forward(token_ids[start : min(start + chunk, n - tail)], 1, None, None)
            if self.progress is not None:
                self.progress(min(start + chunk, n - tail), n)
        logits = self._forward(token_ids[n - tail :], last, None, None)
        if self.progress is not None:
            self.progress(n, n)
        return logits

    def watch_queries(self) -> None:
        """Record each layer's query at the newest position of the next forwards (a retrieval view
        of this cache scores its chunks with them)."""
        self.queries = [None] * len(self.model.base_model.layers)

    def take_queries(self) -> list[torch.Tensor]:
        """The recorded queries, [heads, head_dim] per layer, rotated to the newest position as
        attention rotates them (RoPE); recording stops."""
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        position = torch.tensor([[self.length - 1]], device=self.device)
        queries, self.queries = self.queries, None
        rotated = []
        for query in queries:
            q = query.view(1, heads, 1, head_dim)
            cos, sin = self.model.base_model.rotary_emb(q, position_ids=position)
            halves = torch.cat([-q[..., head_dim // 2 :], q[..., : head_dim // 2]], dim=-1)
            rotated.append((q * cos[:, None] + halves * sin[:, None])[0, :, 0])
        return rotated

    def _forward(
        self, token_ids: torch.Tensor, last: int, positions: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.queries is None:
            return self._call(token_ids, last, positions, mask)
        layers = self.model.base_model.layers
        hooks = [
            layer.self_attn.q_proj.register_forward_hook(
                lambda _module, _inputs, output, i=i: self.queries.__setitem__(i, output[0, -1].detach().clone())
            )
            for i, layer in enumerate(layers)
        ]
        try:
            return self._call(token_ids, last, positions, mask)
        finally:
            for hook in hooks:
                hook.remove()

    def _call(
        self, token_ids: torch.Tensor, last: int, positions: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        inputs = self._inputs(token_ids, positions, mask)
        if self.head_tokens is None:
            out = self.model(**inputs, logits_to_keep=last)
            return out.logits[0, :, : self.width]
        self._read(token_ids)
        hidden = self.model.base_model(**inputs).last_hidden_state[0, -last:]
        logits = torch.full((last, self.width), float("-inf"), dtype=hidden.dtype, device=self.device)
        logits[:, self.head_ids] = hidden @ self.head.T
        return logits

    @torch.inference_mode()  # the cache holds inference tensors, which only change in place in this mode
    def keep(self, path: Sequence[int], new: int) -> None:
        """Of the newest ``new`` cache positions keep those at offsets ``path`` (ascending), in order.

        The shortlist keeps every id read, dropped ones included: it stays exact because drafts
        are sampled from, and verified against, the same restricted distribution.
        """
        path = list(path)
        if path != list(range(len(path))):
            offsets = torch.tensor(path, device=self.device)
            for layer in self.cache.layers:
                if not layer.is_initialized:
                    continue
                start = layer.keys.shape[-2] - new
                index = (offsets + start).to(layer.keys.device)  # a device map may put layers on other GPUs
                for states in (layer.keys, layer.values):  # [batch, heads, length, dim]
                    states[:, :, start : start + len(path)] = states.index_select(2, index)
        if new > len(path):
            self.cache.crop(-(new - len(path)))  # transformers 5.x: a negative count removes that many positions


EVICT_SLACK = 32  # a window may outgrow its budget by this much before it is cut back (one copy per 32 tokens)


class CacheView(HFCausalLM):
    """A model over a part of a sequence's KV cache. Its cache holds fewer positions than the
    sequence, so it gives each token its true position (RoPE) itself; ``length`` is the sequence's.
    With ``window`` it keeps only the sinks and the most recent positions, ``budget`` in all, cutting
    the window back every EVICT_SLACK tokens (the target over a window of its own cache)."""

    def __init__(self, model, width: int, head_tokens=None, budget: int = 0, window: bool = False):
        self.budget, self.window = budget, window
        super().__init__(model, width, head_tokens)

    def reset(self) -> None:
        super().reset()
        self.read = 0

    @property
    def length(self) -> int:
        return self.read

    def _call(self, token_ids, last, positions, mask):
        if mask is not None:
            raise ValueError("a cache view drafts chains: it takes no tree mask")
        if self.window:
            self._evict(len(token_ids))
        positions = torch.arange(self.read, self.read + len(token_ids), device=self.device)
        logits = super()._call(token_ids, last, positions, None)
        self.read += len(token_ids)
        return logits

    def _evict(self, incoming: int) -> None:
        """Cut the window back to the sinks and the newest positions, leaving room for ``incoming``."""
        held = self.cache.get_seq_length()
        if held + incoming <= self.budget + EVICT_SLACK:
            return
        keep = max(self.budget - incoming, SINKS)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = torch.cat([layer.keys[:, :, :SINKS], layer.keys[:, :, held - (keep - SINKS) :]], dim=2)
                layer.values = torch.cat(
                    [layer.values[:, :, :SINKS], layer.values[:, :, held - (keep - SINKS) :]], dim=2
                )

    @torch.inference_mode()
    def keep(self, path: Sequence[int], new: int) -> None:
        super().keep(path, new)
        self.read -= new - len(path)


class SparseView(CacheView):
    """The target over a part of its own KV cache (self-speculation): the sinks and the chunks its
    last query scores highest (TriForce's retrieval cache), or a recent window. Built from the full
    cache after the target's prefill, once per sequence; the tokens it drafts are appended.

    As in TriForce, every token the target has read since is held with the target's own keys and
    values (computed over the whole cache), not the view's: before each forward the view takes them
    over from the target's cache, in place of its own entries for those positions, and skips the
    input tokens they cover. So after a round that accepted every draft it reads only the target's
    bonus token, never its own last draft with it (a 2-token forward costs 1.5-2 one-token ones on
    some CPUs). Its drafts stay its own samples, so verification stays exact."""

    def __init__(self, full: HFCausalLM, budget: int, policy: str):
        self.full, self.policy = full, policy
        super().__init__(full.model, full.width, None, budget, window=policy == "window")

    def watch(self) -> None:
        """Call before the target's prefill: retrieval scores chunks with the last prompt token's queries."""
        if self.policy == "retrieval":
            self.full.watch_queries()

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor) -> None:
        if self.full.length != len(prompt_ids):
            raise ValueError("a sparse view is built from the target's cache right after its prefill")
        self.reset()
        queries = self.full.take_queries() if self.policy == "retrieval" else None
        for i, layer in enumerate(self.full.cache.layers):
            keys, values = layer.keys, layer.values  # [1, kv_heads, length, head_dim]
            kv_heads, length = keys.shape[1], keys.shape[2]
            if queries is None:
                chosen = window_positions(length, self.budget).to(keys.device).expand(kv_heads, -1)
            else:
                chosen = retrieval_positions(queries[i], keys[0], self.budget)
            index = chosen[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
            self.cache.update(keys.gather(2, index), values.gather(2, index), i)
        self.read = self.verified = len(prompt_ids)

    def _call(self, token_ids, last, positions, mask):
        read = self.read
        self._take_verified()
        return super()._call(token_ids[self.read - read :], last, positions, mask)

    def _take_verified(self) -> None:
        """Hold the positions the target has read since the last call with the target's keys and values."""
        upto = self.full.length
        if upto <= self.verified or self.read > upto:  # nothing new, or drafts of its own past it (mid-round)
            return
        # The view's entries from the last verified position on are its newest (its own reading of
        # those tokens, and drafts): they give way to the target's.
        drop = self.read - self.verified
        if drop:
            self.cache.crop(-drop)
        for i, layer in enumerate(self.full.cache.layers):
            self.cache.update(layer.keys[:, :, self.verified : upto], layer.values[:, :, self.verified : upto], i)
        self.read = self.verified = upto


class WindowLM(HFCausalLM):
    """A (small) model over a streaming window of the sequence (StreamingLLM; TriForce's bottom
    level): its cache holds the first tokens and the most recent ones, ``budget`` in all. As in
    StreamingLLM, positions are those within its cache, not in the sequence, so a draft trained on
    short sequences never reads a position beyond ``budget + EVICT_SLACK`` (the shipped draft, trained
    on 256-token sequences, accepts 0.58 at 200 tokens of context and 0.26 at 800 with true
    positions). When the window is full it reads itself again from its tokens, the sinks and the
    newest, at positions 0..: a forward of at most ``budget`` tokens every ``EVICT_SLACK`` tokens.
    A long prompt is read the same way, as its window only. ``length`` is the sequence's."""

    def __init__(self, model, width: int, head_tokens=None, budget: int = 256):
        self.budget = budget
        super().__init__(model, width, head_tokens)

    def reset(self) -> None:
        super().reset()
        self.ids: list[int] = []  # the tokens in its cache, in order
        self.read = 0

    @property
    def length(self) -> int:
        return self.read

    def _call(self, token_ids, last, positions, mask):
        if mask is not None:
            raise ValueError("a window model drafts chains: it takes no tree mask")
        read, ids = self.read + len(token_ids), token_ids.tolist()
        if len(self.ids) + len(ids) > self.budget + EVICT_SLACK:
            every = self.ids + ids
            ids = [every[i] for i in window_positions(len(every), self.budget).tolist()]
            HFCausalLM.reset(self)
            self.ids, token_ids = [], torch.tensor(ids, dtype=token_ids.dtype, device=self.device)
        logits = super()._call(token_ids, last, None, None)  # positions follow the cache: within the window
        self.ids += ids
        self.read = read
        return logits

    @torch.inference_mode()
    def keep(self, path: Sequence[int], new: int) -> None:
        super().keep(path, new)
        if new:
            tail = self.ids[len(self.ids) - new :]
            self.ids[len(self.ids) - new :] = [tail[i] for i in path]
        self.read -= new - len(path)


class _HookedLaps:
    """timing.ForwardLaps driven by a module's forward hooks, so transformers' generate is split into
    phases (and its forwards counted) like specbench's loop."""

    def __init__(self, module, clock, phase: str):
        self.laps = ForwardLaps(clock, phase)
        self._handles = [
            module.register_forward_pre_hook(lambda *_: self.laps.before()),
            module.register_forward_hook(lambda *_: self.laps.after()),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def hf_generate(
    target: LoadedModel,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling,
    seed: int,
    stop_ids: frozenset[int],
    assistant: LoadedModel | None = None,
    k: int | None = None,
    clock=None,
):
    """transformers' own ``generate``: plain, or assisted by ``assistant`` with exactly ``k``
    draft tokens per round (constant schedule, confidence threshold off, so K means what it
    means in specbench's loop). Returns the engine's DecodeResult with forward counts; ``clock``
    (a timing.PhaseClock) is lapped around every forward of both models.

    transformers' first target call also verifies the first drafts, so its prefill holds a round.
    """
    from .engine import DecodeResult

    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": not sampling.greedy,
        "eos_token_id": sorted(stop_ids) or None,
        "pad_token_id": getattr(target.tokenizer, "pad_token_id", None)
        if getattr(target.tokenizer, "pad_token_id", None) is not None
        else min(stop_ids, default=0),
    }
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        if sampling.eta > 0:
            kwargs["eta_cutoff"] = sampling.eta
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if assistant is not None:
        config = assistant.model.generation_config
        config.num_assistant_tokens = k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant.model
    counters = [_HookedLaps(target.model, clock, "verify")]
    if assistant is not None:
        counters.append(_HookedLaps(assistant.model, clock, "draft"))
    torch.manual_seed(seed)  # generate() samples from the global generator
    try:
        ids = prompt_ids.view(1, -1)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    finally:
        for counter in counters:
            counter.remove()
    tokens = out[0, prompt_ids.shape[0] :].tolist()
    result = DecodeResult(tokens=tokens, target_forwards=counters[0].laps.count)
    if assistant is not None:
        result.drafted = counters[1].laps.count  # every assistant call drafts one token, its first one too
        result.draft_forwards = counters[1].laps.count - 1  # after its prefill, as in specbench's loop
        result.accepted = len(tokens) - result.target_forwards  # each target pass adds accepted + 1
    return result
