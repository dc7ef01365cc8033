"""EAGLE drafting: a one-layer head that drafts from the target's own features.

The head is EAGLE-3's, in the checkpoint format vLLM and SGLang load (a ``config.json`` whose
architecture is ``LlamaForCausalLMEagle3`` and a safetensors file of ``midlayer.*``, ``fc``,
``norm``, ``lm_head`` and ``d2t``), so a head trained by ``specbench distill --kind eagle`` runs in
vLLM too, and a published head runs here. For the pair at sequence position t it reads the target's
feature there (the residual stream at a low, a middle and a high layer, fused by ``fc``; or with
``use_aux_hidden_state`` off, the target's final normed states, as EAGLE-1) and the embedding of
the token at t + 1; one decoder layer over its own KV cache predicts the target's next feature, and
its head scores the token at t + 2 over a reduced vocabulary (``d2t`` maps each draft id to a target
id). Every other id gets probability zero, so its rows are an exact q. Further ahead it reads its
own prediction (the layer's output before the final norm) in place of the target's feature. After
each verification the entries it drafted with are dropped, and the accepted tokens are read again
with the features the target computed for them.

This module runs on torch and safetensors; the target's features come from
``lm.HFCausalLM.record_features``. transformers serves only to read a config as vLLM and SGLang read
it (LlamaConfig's defaults, its RoPE parameters) and to compute a scaled RoPE's frequencies.
"""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specbench.core.errors import SpecbenchError, first_said
from specbench.decoding.kv import GrowingKV
from specbench.models.fast import ROPE_TYPES, Linear, Rows, attend, can_pack, join, rms_norm, rope, row_plan, swiglu
from specbench.models.load import REDOWNLOAD, weights_problem

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what config.json names: vLLM's and SGLang's EAGLE-3 loaders read it


WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = "pytorch_model.bin"  # the format some published heads (EAGLE-3's authors') come in


def default_taps(target_layers: int) -> tuple[int, ...]:
    """vLLM's default layers for an EAGLE-3 head: a low, a middle and a high one (their inputs)."""
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class HeadConfig:
    hidden: int  # the head's width, which is the target's embedding width
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's vocabulary
    draft_vocab: int  # the ids the head scores (d2t maps them to target ids)
    taps: tuple[int, ...]  # the target's layers whose inputs it reads; (layers,): its final normed states
    target_hidden: int
    eps: float = 1e-5
    rope_theta: float = 10000.0
    # A scaled RoPE's parameters but its theta (rope_type, factor, ...), as items: () for default RoPE.
    rope_scaling: tuple[tuple[str, object], ...] = ()
    max_positions: int = 2048  # max_position_embeddings (LlamaConfig's default): what yarn's is judged against
    norm_before_residual: bool = False

    @property
    def fused(self) -> bool:
        """Whether several of the target's layers are read, fused by ``fc`` (EAGLE-3); else EAGLE-1's one."""
        return len(self.taps) > 1

    def as_json(self, target_layers: int) -> dict:
        """config.json in the published format, as vLLM and SGLang read it."""
        aux = self.fused
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            **({"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {}),
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab,
            "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": self.target_hidden,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": {
                "use_aux_hidden_state": aux,
                **({"eagle_aux_hidden_state_layer_ids": list(self.taps)} if aux else {}),
                "target_num_hidden_layers": target_layers,
            },
        }

    @classmethod
    def from_json(cls, config: dict, target_layers: int, where: str) -> HeadConfig:
        if "speculators_model_type" in config:
            config = speculators_layout(config, where)
        architectures = config.get("architectures") or []
        if not any("eagle3" in a.lower() for a in architectures):
            raise SpecbenchError(
                f"{where}: config.json names {architectures or 'no architecture'}, not an EAGLE-3 head "
                f"({ARCHITECTURE}): give a head in the EAGLE-3 speculator format"
            )
        eagle = config.get("eagle_config") or {}
        if reasons := sorted({said for name, said in UNRUN.items() if config.get(name) or eagle.get(name)}):
            raise SpecbenchError(
                f"{where}: the head has {' and '.join(reasons)}; specbench runs EAGLE-3 heads of one Llama layer"
            )
        theta, scaling, max_positions = rope_of(config, where)
        if eagle.get("use_aux_hidden_state", True):
            taps = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or default_taps(target_layers))
        else:
            taps = (target_layers,)
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            draft_vocab=config.get("draft_vocab_size") or config["vocab_size"],
            taps=taps,
            target_hidden=config.get("target_hidden_size") or config["hidden_size"],
            eps=config.get("rms_norm_eps", 1e-6),  # LlamaConfig's, which vLLM and SGLang build from this file
            rope_theta=theta,
            rope_scaling=scaling,
            max_positions=max_positions,
            norm_before_residual=bool(config.get("norm_before_residual", False)),
        )


ROPE_FIELDS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
    "original_max_position_embeddings",
)


def rope_of(config: dict, where: str) -> tuple[float, tuple[tuple[str, object], ...], int]:
    """The RoPE a head's (or a target's) config.json gives, as transformers' LlamaConfig reads it (what
    vLLM and SGLang build from the file: rope_parameters, or the older rope_scaling and rope_theta, gaps
    filled by its defaults): its theta, a scaled RoPE's other parameters as HeadConfig.rope_scaling
    holds them (fixed at load: fast.ROPE_TYPES), and max_position_embeddings."""
    from transformers import LlamaConfig

    given = copy.deepcopy({name: config[name] for name in ROPE_FIELDS if config.get(name) is not None})
    try:  # LlamaConfig checks a scaled RoPE's parameters (llama3's factors, yarn's factor) as it reads them
        read = LlamaConfig(**given)
    except (KeyError, ValueError, TypeError) as e:
        raise SpecbenchError(f"{where}: its RoPE parameters do not read as a Llama's: {first_said(e)}") from None
    params = {name: value for name, value in read.rope_parameters.items() if name != "type"}  # the oldest spelling
    kind, theta = params.pop("rope_type", "default"), params.pop("rope_theta")
    if kind not in ROPE_TYPES:
        raise SpecbenchError(f"{where}: RoPE of type {kind}; EAGLE heads here take {', '.join(ROPE_TYPES)} RoPE")
    scaling = () if kind == "default" else tuple(sorted({"rope_type": kind, **params}.items()))
    return float(theta), scaling, read.max_position_embeddings


# What a head may say that one Llama layer does not run (EAGLE-3.1's norms, gpt-oss' norm before fc,
# biases): each changes the forward, so a head that sets one is refused rather than run without it.
UNRUN = {
    "norm_before_fc": "a norm before fc",
    "norm_output": "a norm on its output",
    "fc_norm": "a norm after fc",
    "attention_bias": "biases",
    "mlp_bias": "biases",
}


def rotary_frequencies(c: HeadConfig) -> tuple[torch.Tensor, float]:
    """The head's RoPE: its inverse frequencies [head_dim / 2] in float32, and the factor cos and sin are
    scaled by (yarn's; 1 otherwise), as transformers computes a Llama's of that config."""
    if not c.rope_scaling:
        return 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(c.rope_scaling) | {"rope_theta": c.rope_theta}
    shape = LlamaConfig(
        hidden_size=c.heads * c.head_dim, num_attention_heads=c.heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_positions, rope_parameters=params,
    )  # fmt: skip
    inv_freq, gain = ROPE_INIT_FUNCTIONS[params["rope_type"]](shape, torch.device("cpu"))
    return inv_freq.float(), float(gain)


def speculators_layout(config: dict, where: str) -> dict:
    """A config.json in the speculators library's layout (vLLM's; RedHatAI's published heads) as the
    EAGLE-3 layout that HeadConfig.from_json reads: the decoder layer's fields live in
    ``transformer_layer_config``, the head's own (draft vocabulary, features' width, the norm before the
    residual, the target's layers read, UNRUN's) beside it. Its weights are named as vLLM's
    (``layers.0.*``); its layer count is read from them (read_head), since some configs give the
    verifier's."""
    kind, layer = config.get("speculators_model_type"), config.get("transformer_layer_config")
    if kind != "eagle3":
        raise SpecbenchError(f"{where}: a speculators '{kind}' model, not an EAGLE-3 head: give an eagle3 one")
    if not isinstance(layer, dict):
        raise SpecbenchError(f"{where}: config.json has no transformer_layer_config: not a speculators EAGLE-3 head")
    if layer.get("model_type", "llama") != "llama":
        raise SpecbenchError(
            f"{where}: the head has {layer['model_type']} layers; specbench runs EAGLE-3 heads of one Llama layer"
        )
    from transformers import LlamaConfig

    try:  # omitted fields are LlamaConfig's, as speculators and vLLM read them
        layer = LlamaConfig(**copy.deepcopy(layer)).to_dict()
    except (KeyError, ValueError, TypeError) as e:
        raise SpecbenchError(
            f"{where}: its transformer_layer_config does not read as a Llama's: {first_said(e)}"
        ) from None
    taps = config.get("eagle_aux_hidden_state_layer_ids")
    return (
        layer
        | {name: config[name] for name in UNRUN if name in config}
        | {
            "architectures": config.get("architectures") or [ARCHITECTURE],
            "draft_vocab_size": config.get("draft_vocab_size"),
            "target_hidden_size": config.get("target_hidden_size"),
            # vLLM's default where the field is missing (the library always writes it): the head runs as there
            "norm_before_residual": config.get("norm_before_residual", True),
            "eagle_config": {
                "use_aux_hidden_state": True,
                **({"eagle_aux_hidden_state_layer_ids": taps} if taps else {}),
            },
        }
    )


class Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


def _linear(into: int, out: int) -> nn.Linear:
    return nn.Linear(into, out, bias=False)


class HeadCache:
    """The head's keys and values, [1, kv_heads, length, head_dim] each, appended in place (GrowingKV);
    a crop only moves ``length``."""

    def __init__(self):
        self.grown, self.held, self.length = GrowingKV(), None, 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.held = self.grown.append(self.held, self.length, k, v)
        self.length += k.shape[2]
        return self.held

    def crop(self, length: int) -> None:
        self.length = length


class EagleHead(nn.Module):
    """The head's weights, named as the published format names them, and its forward.

    ``embed`` is the target's token embedding (the format leaves it out unless the head has its own)."""

    def __init__(self, config: HeadConfig, embed: torch.Tensor):
        super().__init__()
        c, h = config, config.hidden
        self.config = config
        self.fc = _linear(len(c.taps) * c.target_hidden, h) if c.fused else None
        self.midlayer = nn.Module()
        layer = self.midlayer
        layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm = Norm(h), Norm(h), Norm(h)
        layer.self_attn = nn.Module()
        layer.self_attn.q_proj = _linear(2 * h, c.heads * c.head_dim)
        layer.self_attn.k_proj = _linear(2 * h, c.kv_heads * c.head_dim)
        layer.self_attn.v_proj = _linear(2 * h, c.kv_heads * c.head_dim)
        layer.self_attn.o_proj = _linear(c.heads * c.head_dim, h)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj, layer.mlp.up_proj = _linear(h, c.intermediate), _linear(h, c.intermediate)
        layer.mlp.down_proj = _linear(c.intermediate, h)
        self.norm = Norm(h)
        self.lm_head = _linear(h, c.draft_vocab)
        self.register_buffer("draft_ids", torch.arange(c.draft_vocab))  # the target id of each draft id
        self.embed = embed.detach()
        inv_freq, self.rope_gain = rotary_frequencies(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        attention, mlp = layer.self_attn, layer.mlp
        # The products by name: the modules' own (trained through), until pack() replaces them.
        self.products = {
            "qkv": lambda x: torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1),
            "o": attention.o_proj,
            "gate_up": lambda x: torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1),
            "down": mlp.down_proj,
            "lm_head": self.lm_head,
            "fc": self.fc,
        }

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.cuda()``: the rotary frequencies follow the weights' device but stay
        float32 (as transformers keeps its own). A position times a bfloat16 frequency is off by whole
        radians past a few thousand positions, and the head's acceptance with it."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def pack(self) -> None:
        """For inference on a CPU, as the target's fast forward runs (models/fast.py): q, k and v as one
        packed product and gate and up as another, beside the modules' own weights, and each row count
        run the way row_plan measures fastest here. Call it after the weights are where they stay;
        training keeps the modules' own products."""
        plan: dict[int, Rows] = {}
        self._products(lambda *modules: Linear.of(*(m.weight for m in modules), packed=True, plan=plan))
        plan.update(row_plan([p for p in self.products.values() if p is not None], self.dtype))

    def join(self) -> None:
        """For inference where nothing is packed (CUDA, the static path): q, k and v as one product and
        gate and up as another, each over one weight that the modules' own parameters become views of
        (fast.join), as the target's forward runs them there: a launch each on CUDA, not three and two."""
        self._products(lambda *modules: Linear.of(join(modules, "weight"), packed=False, plan={}))

    def _products(self, linear) -> None:
        """The products by name, each built by ``linear(*modules)``."""
        attention, mlp = self.midlayer.self_attn, self.midlayer.mlp
        self.products = {
            "qkv": linear(attention.q_proj, attention.k_proj, attention.v_proj),
            "o": linear(attention.o_proj),
            "gate_up": linear(mlp.gate_proj, mlp.up_proj),
            "down": linear(mlp.down_proj),
            "lm_head": linear(self.lm_head),
            "fc": linear(self.fc) if self.fc is not None else None,
        }

    def new_cache(self) -> HeadCache:
        """An empty cache for a new sequence (models/static_head.StaticHead gives its static one)."""
        return HeadCache()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [n, len(taps) * target_hidden] as the layer reads them [n, hidden]."""
        return features if self.fc is None else self.products["fc"](features)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        dtype = self.lm_head.weight.dtype
        cos, sin = angles.cos(), angles.sin()
        if self.rope_gain != 1.0:  # yarn's attention factor, as transformers applies it
            cos, sin = cos * self.rope_gain, sin * self.rope_gain
        return cos.to(dtype)[None, None], sin.to(dtype)[None, None]

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The decoder layer over n pairs (embeddings [n, h], features [n, h]) at ``positions``;
        ``attend(q, k, v)`` ([1, heads or kv_heads, n, d]) is attention over whatever the caller keeps.
        Returns its output before the final norm [n, h]: the feature the next step reads."""
        c, layer = self.config, self.midlayer
        normed = rms_norm(hidden, layer.hidden_norm.weight, c.eps)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([rms_norm(embeds, layer.input_layernorm.weight, c.eps), normed], dim=-1)
        qkv = self.products["qkv"](x)
        cos, sin = self._rotary(positions)
        q, k, v = rope(qkv, cos, sin, c.heads, c.kv_heads, c.head_dim)
        attended = attend(q, k, v)
        x = residual + self.products["o"](attended[0].transpose(0, 1).reshape(len(embeds), c.heads * c.head_dim))
        normed = rms_norm(x, layer.post_attention_layernorm.weight, c.eps)
        return x + self.products["down"](swiglu(self.products["gate_up"](normed)))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary [n, draft_vocab] from the layer's output."""
        return self.products["lm_head"](rms_norm(out, self.norm.weight, self.config.eps))

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the pairs (``hidden`` [n, h], ``tokens`` [n]) to ``cache``; ``mask`` [n, m] bool says
        which of the last m positions (those ending with the new pairs) each attends to, every earlier
        one seen: a tree level's ancestors among the round's nodes (None: causal). Returns the layer's
        output [n, h]."""
        n = len(tokens)

        def attend_cache(q, k, v):
            keys, values = cache.update(k, v)
            if mask is not None:
                allowed = torch.cat([mask.new_ones(n, cache.length - mask.shape[1]), mask], dim=1)
            elif n > 1:  # a causal append: each pair sees the cache and the pairs before it
                allowed = torch.ones(n, cache.length, dtype=torch.bool, device=q.device).tril(cache.length - n)
            else:
                allowed = None
            return attend(q, keys, values, allowed)

        return self.layer(self.embed[tokens], hidden, positions, attend_cache)

    def scored_step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        cache: HeadCache,
        last: int = 1,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``, then the scores after the ``last`` pairs: their outputs [last, h] and the scores of
        the token after each [last, draft_vocab], what a drafter reads next. ``positions`` None: a
        chain, at the positions after what ``cache`` holds. (models/static_head.StaticHead replays both as
        one graph.)"""
        if positions is None:
            start = cache.length
            positions = torch.arange(start, start + len(tokens), device=tokens.device)
        out = self.step(tokens, hidden, positions, cache, mask)[-last:]
        return out, self.draft_logits(out)


def read_head(path: Path, embed: torch.Tensor, target_layers: int, target_hidden: int, vocab: int) -> EagleHead:
    """A head from its checkpoint directory, checked against the target it will draft for."""
    from safetensors.torch import load_file

    where = f"--speculator {path}"
    config_file = path / "config.json"
    weights_file = next((path / name for name in (WEIGHTS, TORCH_WEIGHTS) if (path / name).is_file()), None)
    if not config_file.is_file() or weights_file is None:
        raise SpecbenchError(
            f"{where}: no config.json and {WEIGHTS} (or {TORCH_WEIGHTS}) there; give an EAGLE-3 head's "
            "checkpoint directory"
        )
    config = HeadConfig.from_json(json.loads(config_file.read_text()), target_layers, where)
    if config.hidden != embed.shape[1] or config.target_hidden != target_hidden:
        raise SpecbenchError(
            f"{where}: the head is {config.hidden} wide and reads features {config.target_hidden} wide; the target's "
            f"embeddings are {embed.shape[1]} and its hidden states {target_hidden} wide: this head drafts for another target"
        )
    if config.vocab != vocab:
        raise SpecbenchError(
            f"{where}: the head's vocabulary has {config.vocab} ids and the target's {vocab}: this head drafts for another target"
        )
    if any(not 0 <= t <= target_layers for t in config.taps):
        raise SpecbenchError(f"{where}: the head reads layers {list(config.taps)}; the target has {target_layers}")
    if problem := weights_problem(weights_file):
        raise SpecbenchError(f"{where}: cannot read the weights file {weights_file}: {problem}; {REDOWNLOAD}")
    try:
        if weights_file.name == WEIGHTS:
            weights = load_file(weights_file)
        else:  # tensors only: a pickle that would run code is refused
            weights = torch.load(weights_file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError) as e:
        raise SpecbenchError(f"{where}: cannot read the weights file {weights_file}: {first_said(e)}") from None
    # Counted in the weights: some speculators configs give the verifier's layer count (vLLM's users
    # override it to 1), so the config cannot say.
    layers = {name.split(".")[1] for name in weights if name.startswith("layers.")}
    if len(layers) > 1:
        raise SpecbenchError(f"{where}: the head has {len(layers)} decoder layers; specbench runs EAGLE-3 heads of one")
    own_embed = weights.pop("embed_tokens.weight", None)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    head = EagleHead(config, embed if own_embed is None else own_embed)
    weights = {name.replace("layers.0.", "midlayer."): w for name, w in weights.items()}
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [m for m in missing if m != "draft_ids"]
    if missing or unexpected:
        raise SpecbenchError(
            f"{where}: the weights do not match an EAGLE-3 head: missing {missing[:3]}, unknown {unexpected[:3]}"
        )
    if d2t is not None:
        head.draft_ids.copy_(torch.arange(config.draft_vocab) + d2t.long())
    return head.eval()


def load_head(path: Path, target, pack: bool) -> EagleHead:
    """The head in ``path`` checked against ``target`` (a transformers model), on its device and in
    its dtype, its products packed (``pack``, where the CPU can) or else joined, as the target's forward
    runs its own."""
    config = target.config
    embed = target.get_input_embeddings().weight
    head = read_head(path, embed, config.num_hidden_layers, config.hidden_size, config.vocab_size)
    head = head.to(embed.device, embed.dtype)
    # The embedding is a plain tensor (the target's, or the head's own): .to() skips it.
    head.embed = head.embed.to(embed.device, embed.dtype)
    if pack and can_pack(head, head.config.hidden):
        head.pack()
    else:
        head.join()
    return head


def save_head(head: EagleHead, path: Path, target_layers: int) -> None:
    """The head in the published format (what read_head and vLLM load); the target's embedding stays out."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {name: w.detach().half().contiguous() for name, w in head.state_dict().items() if name != "draft_ids"}
    if head.config.draft_vocab < head.config.vocab:  # vLLM refuses a mapping for the full vocabulary
        state["d2t"] = head.draft_ids - torch.arange(head.config.draft_vocab, device=head.draft_ids.device)
    save_file({name: w.cpu() for name, w in state.items()}, str(path / WEIGHTS))
    (path / "config.json").write_text(json.dumps(head.config.as_json(target_layers), indent=2) + "\n")


class HeadLM:
    """The head as the cost measurement times a drafting model (models/costs.py): a forward reads tokens, each
    with a feature (zeros: the time does not depend on the values), and scores the next over the
    draft vocabulary."""

    def __init__(self, head: EagleHead):
        self.head, self.device = head, head.lm_head.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.new_cache()

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        self.reset()
        self.forward(prompt_ids)

    def forward(self, token_ids: torch.Tensor, last: int = 1, positions=None, mask=None) -> torch.Tensor:
        if last != 1:
            raise ValueError("the head's cost probe scores the token after the last only")
        hidden = self.head.embed.new_zeros(len(token_ids), self.head.config.hidden)
        return self.head.scored_step(token_ids, hidden, self.cache)[1]

    def keep(self, path, new: int) -> None:
        if list(path) != list(range(len(path))):
            raise ValueError("the head's cost probe keeps a prefix only")
        self.cache.crop(self.cache.length - new + len(path))

    @property
    def length(self) -> int:
        return self.cache.length
