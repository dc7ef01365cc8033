"""A draft as a student of its target: training examples (the teacher's top-k rows at labelled
positions), their batches, the student's logits there, the distillation loss, and a draft checkpoint.
Both distillation (training/) and the online method (methods/online.py) train drafts with these."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specbench.models.load import HEAD_TOKENS


@dataclass
class Example:
    """A token sequence and the teacher's top-k next-token distributions at positions
    ``start`` .. ``start + len(top_logp) - 1``, or at ``positions`` when given (online lessons are
    scattered); other positions carry no loss."""

    ids: torch.Tensor
    start: int
    top_logp: torch.Tensor
    top_idx: torch.Tensor
    positions: torch.Tensor | None = None
    features: torch.Tensor | None = None  # an EAGLE head's: the target's features at every position


def collate(examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors; with causal attention the padding cannot reach real positions."""
    rows, length, k = len(examples), max(len(e.ids) for e in examples), examples[0].top_logp.shape[-1]
    batch = {
        "ids": torch.zeros(rows, length, dtype=torch.long),
        "top_logp": torch.zeros(rows, length, k),
        "top_idx": torch.zeros(rows, length, k, dtype=torch.long),
        "labelled": torch.zeros(rows, length, dtype=torch.bool),
    }
    for r, e in enumerate(examples):
        labelled = e.positions if e.positions is not None else slice(e.start, e.start + len(e.top_logp))
        batch["ids"][r, : len(e.ids)] = e.ids
        batch["top_logp"][r, labelled] = e.top_logp.float()
        batch["top_idx"][r, labelled] = e.top_idx.long()
        batch["labelled"][r, labelled] = True
    return batch


def labelled_logits(student, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The student's logits at the labelled positions only: the vocabulary projection is most of
    a small draft's cost, and prompt positions carry no loss."""
    hidden = student.base_model(input_ids=batch["ids"]).last_hidden_state
    return student.get_output_embeddings()(hidden[batch["labelled"]])


def kd_loss(student_logits: torch.Tensor, top_logp: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's renormalised top-k distribution."""
    teacher = top_logp.float().softmax(-1)
    student_logp = student_logits.float().log_softmax(-1).gather(-1, top_idx)
    return -(teacher * student_logp).sum(-1).mean()


def save_checkpoint(model, tokenizer, out: Path, shortlist: list[int] | None) -> None:
    """A plain half-precision checkpoint with ``tokenizer``, loadable with --draft DIR, and the
    vocabulary shortlist specbench's draft projection uses (none: the full projection)."""
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).eval().half().save_pretrained(out)  # a copy: the caller's model keeps its dtype
    tokenizer.save_pretrained(out)
    if shortlist is not None:
        (out / HEAD_TOKENS).write_text(json.dumps(shortlist) + "\n")
