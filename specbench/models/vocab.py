"""Two vocabularies side by side: a target and a draft whose tokenizers differ.

``Bridge`` holds each id's text and the encoders and decoders of whole texts of both sides, and the
conversions the drafters that cross vocabularies make (drafters/vocab.py): which ids both hold, a
target token in the draft's ids, a draft's text in the target's. It sees ids and texts, never a
model, so tests build one from a handful of strings. ``VocabView`` is a draft model seen through a
Bridge in the target's ids, as models/lm.py's views are models seen over part of their cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from specbench.core.errors import SpecbenchError

# Below this share of the prompts' target tokens in both vocabularies a draft is refused: its
# intersection could propose too few of the target's tokens for drafting to pay, and its text is
# likely a script the draft was not trained on.
MIN_SHARE = 0.5


@dataclass
class Bridge:
    """Two vocabularies side by side: each id's text, and the encoders and decoders of whole texts.

    ``to_draft[t]`` is the draft id whose text is target id t's (-1: none), ``to_target`` the reverse;
    a text held by several ids of one side maps to the lowest. Ids whose text alone is not whole (a
    byte of a character split over several tokens decodes to U+FFFD) or is empty are not shared."""

    target_texts: list[str]
    draft_texts: list[str]
    target_encode: Callable[[str], list[int]]
    draft_encode: Callable[[str], list[int]]
    target_decode: Callable[[list[int]], str]
    draft_decode: Callable[[list[int]], str]
    to_draft: list[int] = field(init=False)
    to_target: list[int] = field(init=False)
    _pieces: dict[int, list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self):
        first: dict[str, int] = {}
        for i, text in enumerate(self.draft_texts):
            if whole(text):
                first.setdefault(text, i)
        self.to_draft = [-1] * len(self.target_texts)
        self.to_target = [-1] * len(self.draft_texts)
        for t, text in enumerate(self.target_texts):
            d = first.get(text, -1) if whole(text) else -1
            if d >= 0 and self.to_target[d] < 0:
                self.to_draft[t], self.to_target[d] = d, t

    @property
    def shared(self) -> int:
        """Ids in both vocabularies."""
        return sum(t >= 0 for t in self.to_target)

    def share(self, target_ids: Sequence[int]) -> float:
        """The share of ``target_ids`` that the draft holds as tokens of its own (the intersection's
        reach over a text); 1.0 for no ids."""
        ids = list(target_ids)
        return sum(self.to_draft[t] >= 0 for t in ids) / len(ids) if ids else 1.0

    def spellable(self, target_ids: Sequence[int]) -> float:
        """The share of ``target_ids`` whose text the draft's tokenizer writes and reads back unchanged
        (what text drafting can propose); 1.0 for no ids."""
        ids = list(target_ids)
        ok = sum(self.draft_decode(self.draft_encode(self.target_texts[t])) == self.target_texts[t] for t in ids)
        return ok / len(ids) if ids else 1.0

    def pieces(self, target_id: int) -> list[int]:
        """The draft ids that read target token ``target_id``: its counterpart, or its text tokenized."""
        if target_id not in self._pieces:
            d = self.to_draft[target_id] if target_id < len(self.to_draft) else -1
            # A token with no text (a padding id) is read as the draft's id 0: every token takes a position.
            self._pieces[target_id] = [d] if d >= 0 else self.draft_encode(self.target_decode([target_id])) or [0]
        return self._pieces[target_id]

    def draft_ids(self, target_ids: Sequence[int]) -> list[list[int]]:
        """The draft ids of each of ``target_ids``, token by token (pieces)."""
        return [self.pieces(t) for t in target_ids]

    def draft_prompt(self, target_ids: Sequence[int]) -> list[int]:
        """A prompt in the draft's ids: its text tokenized whole, as the draft was trained to read text."""
        return self.draft_encode(self.target_decode(list(target_ids)))

    def target_ids(self, draft_ids: Sequence[int]) -> list[int]:
        """The target's ids for the text of ``draft_ids``."""
        return self.target_encode(self.draft_decode(list(draft_ids)))

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared ids as two aligned tensors on ``device``: draft ids, and their target ids."""
        pairs = [(d, t) for d, t in enumerate(self.to_target) if t >= 0]
        draft, target = zip(*pairs, strict=True) if pairs else ((), ())
        return (
            torch.tensor(draft, dtype=torch.long, device=device),
            torch.tensor(target, dtype=torch.long, device=device),
        )


def whole(text: str) -> bool:
    return bool(text) and "\ufffd" not in text


def bridge_of(target_tokenizer, draft_tokenizer, target_width: int, draft_width: int) -> Bridge:
    """The Bridge of two transformers tokenizers, over the logit widths of their models (ids past a
    tokenizer's vocabulary, a model's padding, have no text). Texts are decoded with special tokens
    kept and no clean-up, so that the chat template's markers and end-of-turn tokens are shared too."""

    def texts(tokenizer, width: int) -> list[str]:
        size = min(width, len(tokenizer))
        decoded = tokenizer.batch_decode([[i] for i in range(size)], **KEEP)
        return decoded + [""] * (width - size)

    def encoder(tokenizer):
        return lambda text: tokenizer.encode(text, add_special_tokens=False)

    def decoder(tokenizer):
        return lambda ids: tokenizer.decode(ids, **KEEP)

    return Bridge(
        texts(target_tokenizer, target_width),
        texts(draft_tokenizer, draft_width),
        encoder(target_tokenizer),
        encoder(draft_tokenizer),
        decoder(target_tokenizer),
        decoder(draft_tokenizer),
    )


KEEP = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}


def check_share(bridge: Bridge, prompts: Sequence[Sequence[int]], target: str, draft: str) -> float:
    """The share of the prompts' target tokens the draft holds (Bridge.share); raise SpecbenchError
    below MIN_SHARE."""
    share = bridge.share([t for ids in prompts for t in ids])
    if share < MIN_SHARE:
        raise SpecbenchError(
            f"{draft}'s vocabulary holds {share:.0%} of the prompts' tokens of {target} (at least {MIN_SHARE:.0%} "
            "is needed to draft across vocabularies): use a draft whose tokenizer was trained on text like these prompts"
        )
    return share


@contextmanager
def retokenizing(clock):
    """Time spent converting between the vocabularies, as the ``retokenize`` phase of ``clock``
    (timing.PhaseClock; None: untimed)."""
    if clock is not None:
        clock.lap("other")
    yield
    if clock is not None:
        clock.lap("retokenize")


class VocabView:
    """A draft model seen in the target's ids (a decode.CausalLM): it reads target ids (each as its
    Bridge.pieces) and returns rows over the target's vocabulary that hold the draft's logits at the
    shared ids and -inf elsewhere, so that a ModelDrafter over it draws from the intersection, with
    that restricted, renormalised row as its q: token-level intersection.

    Its positions are the target's: ``spans[i]`` is how many draft positions target token i took
    (the prompt is one span), so ``keep`` drops a rejected draft token's one position, or a target
    token's several. Chains only: a tree's positions and mask are refused."""

    def __init__(self, draft, bridge: Bridge, width: int, clock=None):
        self.draft, self.bridge, self.width, self.clock = draft, bridge, width, clock
        self.device = draft.device
        self.draft_index, self.target_index = bridge.index(self.device)
        self.spans: list[int] = []

    def reset(self) -> None:
        self.draft.reset()
        self.spans = []

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        with retokenizing(self.clock):
            ids = self.bridge.draft_prompt(prompt_ids.tolist())
        self.draft.prefill(torch.tensor(ids, dtype=torch.long, device=self.device))
        self.spans = [0] * (len(prompt_ids) - 1) + [len(ids)]

    def forward(self, token_ids: torch.Tensor, last: int = 1, positions=None, mask=None) -> torch.Tensor:
        if positions is not None or mask is not None:
            raise ValueError("drafting across vocabularies drafts chains: a tree's mask has no draft positions")
        with retokenizing(self.clock):
            pieces = self.bridge.draft_ids(token_ids.tolist())
            ids = torch.tensor([d for piece in pieces for d in piece], dtype=torch.long, device=self.device)
        self.spans += [len(piece) for piece in pieces]
        # Each of the last ``last`` target tokens' row is the draft's after that token's last piece.
        ends = list(accumulate(self.spans[len(self.spans) - last :]))
        rows = self.draft.forward(ids, last=ends[-1])
        draft_rows = rows[[end - 1 for end in ends]] if last > 1 else rows[-1:]
        out = torch.full((last, self.width), float("-inf"), dtype=rows.dtype, device=self.device)
        out[:, self.target_index] = draft_rows[:, self.draft_index]
        return out

    def keep(self, path: Sequence[int], new: int) -> None:
        if not new:
            return
        tail = self.spans[len(self.spans) - new :]
        starts = [sum(tail[:i]) for i in range(new)]
        kept = [starts[i] + j for i in path for j in range(tail[i])]
        self.draft.keep(kept, sum(tail))
        self.spans[len(self.spans) - new :] = [tail[i] for i in path]

    @property
    def length(self) -> int:
        return len(self.spans)
