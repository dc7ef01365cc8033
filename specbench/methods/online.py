"""Online draft updates (Online Speculative Decoding): between prompts, the draft learns the
target's distribution at the positions where the target rejected it.

The target's logits there exist already from verification; their top-k log-probabilities are
kept as the round is decoded, so the target never runs again for training. A float32 copy of the
draft learns them with distill's loss; the copy that decodes takes its weights after an update.
Updates happen only between prompts, so every prompt is decoded by one fixed draft and the
output stays exactly the target's (speculative sampling is exact whatever the draft).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from specbench.decoding.decode import DecodeResult, Round
from specbench.decoding.timing import synchronize
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM
from specbench.models.load import LoadedModel
from specbench.models.student import Example, collate, kd_loss, labelled_logits, save_checkpoint

TOP_K = 32  # target probabilities kept per rejected position, as distill keeps per position


@dataclass
class Lesson:
    """The target's distribution where it rejected the draft."""

    position: int  # index in the output of the token the target put in place of the draft's
    top_logp: torch.Tensor  # [TOP_K] the target's log-probabilities there (unwarped, as distill's teacher)
    top_idx: torch.Tensor  # [TOP_K] their token ids


@dataclass
class Lessons(DecodeResult):
    """An online decode's result: what it decoded, and the lessons of its rounds, which the learner
    takes after the prompt (from the timed repeat that was kept)."""

    lessons: list[Lesson] = field(default_factory=list)

    @classmethod
    def of(cls, result: DecodeResult, lessons: list[Lesson]) -> Lessons:
        return cls(**{f.name: getattr(result, f.name) for f in fields(result)}, lessons=lessons)


def rejection(round_: Round, at: int, top_k: int = TOP_K) -> Lesson | None:
    """The lesson of a chain round whose first emitted token is output token ``at``: the target's
    row at the first rejected draft token, or None when it accepted them all."""
    n = round_.verdict.accepted
    if n == len(round_.draft.tokens):
        return None
    top = round_.logits[n].float().log_softmax(-1).topk(min(top_k, round_.logits.shape[-1]))
    return Lesson(at + n, top.values, top.indices)


@dataclass(frozen=True)
class OnlineConfig:
    """--online-every, --online-steps and --online-lr (their defaults are argued in methods/registry.py)."""

    every: int  # prompts between updates
    steps: int  # optimiser steps per update, each over every lesson gathered since the last
    lr: float


@dataclass
class Learned:
    """What happened after one prompt."""

    lessons: int  # rejected positions the prompt gave
    updates: int  # updates of the draft so far
    train_s: float  # seconds of training after this prompt (0 when it did not update)


class OnlineLearner:
    """A run's learning copy of the draft: ``lm`` decodes, a float32 ``student`` trains."""

    def __init__(self, draft: LoadedModel, width: int, online: OnlineConfig, device: torch.device, fast: bool = False):
        self.draft, self.online, self.device = draft, online, device
        self.student = copy.deepcopy(draft.model).to(device=device, dtype=torch.float32).train()
        # The shipped draft is never changed: both copies are the learner's own.
        decoding = copy.deepcopy(draft.model).eval()
        self.lm = HFCausalLM(decoding, width, draft.head_tokens, FastLlama(decoding) if fast else None)
        # Only the decoder layers learn. The embedding is also the (tied) head: every one of its rows
        # gets a gradient through the softmax, and Adam would move each by about the learning rate
        # whatever that gradient's size, reshaping the whole vocabulary after a few lessons.
        embeddings = {id(self.student.get_input_embeddings().weight), id(self.student.get_output_embeddings().weight)}
        learned = [p for p in self.student.parameters() if id(p) not in embeddings]
        for p in self.student.parameters():
            p.requires_grad_(id(p) not in embeddings)
        self.optimizer = torch.optim.AdamW(learned, lr=online.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.buffer: list[Example] = []
        self.prompts = self.updates = 0

    def learn(self, prompt_ids: torch.Tensor, result: Lessons) -> Learned:
        """Keep the prompt's lessons; every ``every`` prompts, update the draft on those gathered."""
        self.prompts += 1
        lessons = [lesson for lesson in result.lessons if lesson.position <= len(result.tokens)]
        if lessons:
            ids = torch.cat([prompt_ids.cpu(), torch.tensor(result.tokens, dtype=prompt_ids.dtype)])
            # Output token j is predicted at sequence position len(prompt) + j - 1.
            positions = torch.tensor([len(prompt_ids) + lesson.position - 1 for lesson in lessons])
            top_logp = torch.stack([lesson.top_logp for lesson in lessons]).cpu()
            top_idx = torch.stack([lesson.top_idx for lesson in lessons]).cpu()
            self.buffer.append(Example(ids, 0, top_logp, top_idx, positions))
        train_s = 0.0
        if self.prompts % self.online.every == 0 and self.buffer:
            synchronize(self.device)
            start = time.perf_counter()
            self.update()
            synchronize(self.device)
            train_s = time.perf_counter() - start
        return Learned(len(lessons), self.updates, train_s)

    def update(self) -> None:
        batch = {name: tensor.to(self.device) for name, tensor in collate(self.buffer).items()}
        labelled = batch["labelled"]
        for _ in range(self.online.steps):
            loss = kd_loss(
                labelled_logits(self.student, batch), batch["top_logp"][labelled], batch["top_idx"][labelled]
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], 1.0)
            self.optimizer.step()
        with torch.no_grad():
            self.lm.model.load_state_dict(self.student.state_dict())
        # The target's first choices join a shortlisted head, so the draft can now propose them.
        self.lm.refresh(batch["top_idx"][labelled][:, 0].unique())
        self.buffer.clear()
        self.updates += 1

    def save(self, out: Path) -> None:
        """The updated draft as a checkpoint that ``--draft DIR`` loads, with its grown shortlist."""
        shortlist = None if self.lm.head_tokens is None else sorted(self.lm.head_tokens.tolist())
        meta = {
            **asdict(self.online),
            "started_from": str(self.draft.path),
            "prompts": self.prompts,
            "updates": self.updates,
        }
        save_checkpoint(self.student, self.draft.tokenizer, out, shortlist)
        (out / "online.json").write_text(json.dumps(meta, indent=2) + "\n")
