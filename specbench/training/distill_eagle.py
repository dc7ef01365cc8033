"""``specbench distill --kind eagle``: an EAGLE-3 head for a Llama-architecture target, trained on
distill's data.

distill's teacher and generate phases run as for a draft (the same shards, resumed alike), then:
3. features: the target reads every training sequence again, and the inputs of the head's decoder
   layers (vLLM's default: 2, L/2 and L-3), recorded as inference records them (lm.record_features),
   are stored in float16 shards laid out as the data;
4. head: EAGLE-3's training-time test. The pair at position t is (feature f_t, token x_{t+1}); the
   layer's output there scores x_{t+2} against the teacher's distribution at t+1. Step j >= 1
   reads at position t+j the pair (the step j-1 output of the same chain, x_{t+j+1}) and scores
   x_{t+j+2}; it attends to the step-0 entries of positions <= t (the target-feature pairs the
   head's cache holds after a verification) and to its own chain's steps 1..j, as EagleDrafter
   does. The loss at step j is weighted 0.8**j.

Two choices the published format allows make a target with large activations trainable (SmolLM2:
the middle and high layers' residual stream has an RMS near 100, one dimension 2,000 times the
median one and 25,000 at a sequence's first position): the head normalises its input before its
residual (``norm_before_residual``, which vLLM reads), and ``fc`` trains as W / s, s each feature's
RMS over the data, so every tap and dimension starts on an equal footing; W / s is what is saved.

The result is ``save_head``'s checkpoint (what ``--speculator DIR`` and vLLM load) and distill.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from specbench.core.errors import SpecbenchError
from specbench.core.files import replacing
from specbench.models.eagle_head import EagleHead, HeadConfig, default_taps, read_head, rope_of, save_head
from specbench.models.fast import FAMILIES, FastLlama, attend, unsupported
from specbench.models.lm import HFCausalLM
from specbench.models.load import LoadedModel
from specbench.models.names import speculator_dir
from specbench.models.student import Example, collate
from specbench.training.distill import (
    FEATURES,
    DistillConfig,
    TrainingProgress,
    coverage,
    data_shards,
    distill,
    feature_path,
    head_tokens,
    load_examples,
    optimise,
    recipe,
    shard_sequences,
)

# The head reads the inputs of a low, a middle and a high layer of the target: vLLM's default
# 2, L/2 and L-3, which the saved head names for vLLM's eagle3 too. A target of fewer than 3
# layers has no layer 2 or no layer L-3; rather than stand other layers in for them (little more
# than the embeddings, which the head reads anyway), distill refuses it: a draft suits a target that small.
MIN_LAYERS = 3
STEP_WEIGHT = 0.8  # EAGLE-3's: the loss at training-time test step j counts 0.8**j


def distill_eagle(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    config = target.model.config
    if config.model_type not in FAMILIES:  # their decoder layers and final norm are where the features are read
        raise SpecbenchError(
            f"--kind eagle trains a head for a Llama-shaped target ({', '.join(FAMILIES)}); "
            f"{cfg.target} is {config.model_type}"
        )
    layers = config.num_hidden_layers
    if layers < MIN_LAYERS:
        raise SpecbenchError(
            f"--kind eagle reads the inputs of the target's layers 2, L/2 and L-3 (vLLM's default), so it needs "
            f"a target of at least {MIN_LAYERS} decoder layers and {cfg.target} has {layers}: use --kind draft for it"
        )
    yield from distill(cfg, target, train=train_head)


def taps_of(target: LoadedModel) -> tuple[int, ...]:
    return default_taps(target.model.config.num_hidden_layers)


def feature_shards(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    """The target's features at every position of every training sequence; existing shards are kept."""
    shards = {path: shard_sequences(path) for path in data_shards(cfg)}
    total, done, lm = sum(map(len, shards.values())), 0, None
    for path, sequences in shards.items():
        out = feature_path(path)
        if out.exists():
            done += len(sequences)
            yield TrainingProgress(FEATURES, done, total)
            continue
        if lm is None:  # the forward inference runs, so the head learns the features it will read
            fast = None if unsupported(target.model) else FastLlama(target.model)
            lm = HFCausalLM(target.model, target.width, fast=fast)
            lm.record_features(taps_of(target))
        stored = []
        for ids in sequences:
            lm.prefill(ids.long().to(target.model.device))
            stored.append(lm.features.half().cpu())
            yield TrainingProgress(FEATURES, done + len(stored), total)
        done += len(sequences)
        out.parent.mkdir(parents=True, exist_ok=True)
        with replacing(out) as tmp:
            torch.save(stored, tmp)


def new_head(cfg: DistillConfig, target: LoadedModel, draft_ids: list[int]) -> EagleHead:
    """A head scoring ``draft_ids``. Afresh, it is shaped as one of the target's layers, its LM head
    starts as the target's rows of those ids and its final norm as the target's, and the rest is
    small and random. With --init HEAD it is that head, its shape kept, its LM head cut or grown to
    ``draft_ids``: the rows of ids it scored are kept, the others start as the target's."""
    c, model = target.model.config, target.model
    embed = model.get_input_embeddings().weight.detach().float()
    earlier = None
    if cfg.goes_on:
        earlier = read_head(speculator_dir(cfg.init), embed, c.num_hidden_layers, c.hidden_size, c.vocab_size)
        if earlier.config.taps != taps_of(target):
            raise SpecbenchError(
                f"--init {cfg.init}: the head reads layers {list(earlier.config.taps)} and distill stores the "
                f"features of layers {list(taps_of(target))}: start from pca instead"
            )
        config = replace(earlier.config, draft_vocab=len(draft_ids))
    else:
        theta, scaling, max_positions = rope_of(c.to_dict(), f"--target {cfg.target}")
        config = HeadConfig(
            hidden=c.hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            intermediate=cfg.head_intermediate or c.intermediate_size,
            vocab=c.vocab_size,
            draft_vocab=len(draft_ids),
            taps=taps_of(target),
            target_hidden=c.hidden_size,
            eps=c.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,  # the target's: the head reads its positions as the target does
            max_positions=max_positions,
            norm_before_residual=True,
        )
    torch.manual_seed(cfg.seed)
    head = EagleHead(config, embed)
    rows = model.get_output_embeddings().weight[torch.tensor(draft_ids)].detach().clone()
    with torch.no_grad():
        head.draft_ids.copy_(torch.tensor(draft_ids))
        if earlier is None:
            head.norm.weight.copy_(model.model.norm.weight)
        else:
            kept = {k: w for k, w in earlier.state_dict().items() if k not in ("lm_head.weight", "draft_ids")}
            head.load_state_dict(kept, strict=False)
            earlier_row = draft_index(earlier.draft_ids, config.vocab)[torch.tensor(draft_ids)]
            known = earlier_row >= 0
            rows[known] = earlier.lm_head.weight[earlier_row[known]]
        head.lm_head.weight.copy_(rows)
    return head


def draft_index(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each target id's row among ``draft_ids`` [vocab], -1 where the head does not score it."""
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[draft_ids] = torch.arange(len(draft_ids))
    return index


class DividedBy(nn.Module):
    """fc's weight as W / scale (column-wise): training W sees features divided by ``scale``."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale


def feature_scale(examples: list[Example]) -> torch.Tensor:
    """Each feature's RMS over the examples, leaving out every sequence's first position (where
    the target's massive activations are)."""
    squares = sum(e.features[1:].float().pow(2).sum(0) for e in examples)
    count = sum(len(e.features) - 1 for e in examples)
    return (squares / max(count, 1)).sqrt().clamp(min=1e-2)


def ttt_mask(length: int, step: int) -> torch.Tensor:
    """What each chain attends to at ``step`` [length, (step + 1) length]: the step-0 entries of its
    position and before, then its own entries of steps 1..step."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.cat([causal, *[torch.eye(length, dtype=torch.bool)] * step], dim=1)


def ttt_outputs(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The layer's outputs [rows, length, hidden] at each step of the training-time test, for
    sequences ``ids`` [rows, length] with the target's ``features`` [rows, length, taps * hidden].
    Row t of step j is chain t's output at position t + j (see the module's docstring)."""
    rows, length = ids.shape
    positions = torch.arange(length, device=ids.device).repeat(rows)
    keys, values = [], []

    def per_row(x: torch.Tensor) -> torch.Tensor:  # [1, heads, rows * length, d] -> [rows, heads, length, d]
        return x[0].unflatten(1, (rows, length)).transpose(0, 1)

    def attend_chains(q, k, v):
        keys.append(per_row(k))
        values.append(per_row(v))
        mask = ttt_mask(length, len(keys) - 1).to(q.device)
        out = attend(per_row(q), torch.cat(keys, 2), torch.cat(values, 2), mask)
        return out.transpose(0, 1).flatten(1, 2)[None]

    hidden, outs = head.fuse(features.flatten(0, 1)), []
    for step in range(steps):
        tokens = F.pad(ids[:, step + 1 :], (0, step + 1))  # chain t reads x_{t+step+1}
        hidden = head.layer(head.embed[tokens.flatten()], hidden, positions + step, attend_chains)
        outs.append(hidden.view(rows, length, -1))
    return outs


def _batch(examples: list[Example]) -> dict[str, torch.Tensor]:
    batch = collate(examples)
    width = examples[0].features.shape[-1]
    batch["features"] = torch.zeros(len(examples), batch["ids"].shape[1], width)
    for r, e in enumerate(examples):
        batch["features"][r, : len(e.ids)] = e.features.float()
    return batch


def _targets(batch: dict[str, torch.Tensor], out: torch.Tensor, step: int):
    """Step ``step``'s outputs that carry a loss, and the teacher there: row t scores the teacher at t+step+1."""
    labelled = batch["labelled"][:, step + 1 :]
    shifted = out[:, : labelled.shape[1]]
    return shifted[labelled], batch["top_logp"][:, step + 1 :][labelled], batch["top_idx"][:, step + 1 :][labelled]


def ttt_loss(head: EagleHead, batch: dict[str, torch.Tensor], to_draft: torch.Tensor, steps: int) -> torch.Tensor:
    """Cross-entropy against the teacher's top-k renormalised over the draft vocabulary (positions
    where it holds none of them are skipped), summed over the steps with weights 0.8**j."""
    total = 0.0
    for step, out in enumerate(ttt_outputs(head, batch["ids"], batch["features"], steps)):
        rows, top_logp, top_idx = _targets(batch, out, step)
        draft_idx = to_draft[top_idx]
        known = draft_idx >= 0
        keep = known.any(-1)
        if not keep.any():
            continue
        teacher = top_logp[keep].float().masked_fill(~known[keep], float("-inf")).softmax(-1)
        logq = head.draft_logits(rows[keep]).float().log_softmax(-1).gather(-1, draft_idx[keep].clamp(min=0))
        loss = -(teacher * logq.masked_fill(~known[keep], 0.0)).sum(-1).mean()
        total = total + STEP_WEIGHT**step * loss
    return total


def ttt_agreement(head: EagleHead, examples: list[Example], batch: int, steps: int) -> tuple[float, ...] | None:
    """How often the head's top token at each step is the teacher's top token, over the labelled
    positions (an id outside the draft vocabulary counts as a miss)."""
    if not examples:
        return None
    hits, total = [0] * steps, [0] * steps
    head.eval()
    with torch.inference_mode():
        for i in range(0, len(examples), batch):
            b = _batch(examples[i : i + batch])
            for step, out in enumerate(ttt_outputs(head, b["ids"], b["features"], steps)):
                rows, _, top_idx = _targets(b, out, step)
                chosen = head.draft_ids[head.draft_logits(rows).argmax(-1)]
                hits[step] += (chosen == top_idx[:, 0]).sum().item()
                total[step] += len(rows)
    return tuple(h / max(t, 1) for h, t in zip(hits, total, strict=True))


def train_head(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    """The features phase, then the head trained (or its training resumed) on them."""
    yield from feature_shards(cfg, target)
    examples, held_out = load_examples(cfg, features=True)
    draft_ids = head_tokens(examples, cfg.draft_vocab, target.width)
    head = new_head(cfg, target, draft_ids)
    if head.fc is not None:
        scale = feature_scale(examples)
        if cfg.goes_on:  # the saved fc is W / s as inference applies it; training holds W
            with torch.no_grad():
                head.fc.weight.mul_(scale)
        parametrize.register_parametrization(head.fc, "weight", DividedBy(scale))
    to_draft = draft_index(head.draft_ids, head.config.vocab)

    def batch_loss(rows: list[int]) -> torch.Tensor:
        return ttt_loss(head, _batch([examples[i] for i in rows]), to_draft, cfg.ttt_steps)

    def evaluate():
        return ttt_agreement(head, held_out, cfg.batch, cfg.ttt_steps)

    lengths = [len(e.ids) for e in examples]
    held = yield from optimise(cfg, head, lengths, batch_loss, evaluate, phase="head")
    if head.fc is not None:  # the published format holds fc's weight as inference applies it
        parametrize.remove_parametrizations(head.fc, "weight")
    layers = target.model.config.num_hidden_layers
    save_head(head, cfg.out, layers)
    meta = recipe(cfg)
    meta.update(
        feature_layers=list(head.config.taps),
        intermediate_size=head.config.intermediate,
        draft_vocab=len(draft_ids),
        held_out_coverage=coverage(draft_ids, held_out),
        held_out_greedy_agreement=held[0] if held else None,
        held_out_agreement_by_step=list(held) if held else None,
    )
    if cfg.goes_on:  # a head trained further keeps the recipe it started from
        earlier = speculator_dir(cfg.init) / "distill.json"
        if earlier.is_file():
            meta["init_recipe"] = json.loads(earlier.read_text())
    (cfg.out / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")
