"""A draft's own tokenizer, for `specbench distill --tokenizer-vocab N` (training/distill_own_tokenizer.py).

A byte-level BPE of N tokens trained with the `tokenizers` library on text specbench may train on,
saved as a transformers tokenizer (tokenizer.json, tokenizer_config.json) that AutoTokenizer loads
offline. Byte-level, so every text round-trips exactly: decode(encode(text)) == text, whatever its
script. It keeps the target's special tokens (its added tokens, such as <|im_start|> and <|im_end|>,
each one token that training text never splits), its bos, eos, pad and unk tokens, the special tokens
its tokenizer adds around a text, its padding side and its chat template, so that a chat prompt
renders and tokenizes for the draft as it does for the target.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import cache


@cache
def byte_of() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's mapping, which the
    ByteLevel pre-tokenizer of `tokenizers` uses: printable bytes as themselves, the others shifted
    past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def added_tokens(tokenizer) -> list[tuple[str, bool]]:
    """The tokenizer's added tokens in id order, each (content, special), with its bos, eos, pad and unk
    tokens among them when they are not already."""
    found = [(t.content, t.special) for _, t in sorted(tokenizer.added_tokens_decoder.items())]
    named = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token)
    have = {content for content, _ in found}
    return found + [(t, True) for t in dict.fromkeys(named) if t is not None and t not in have]


def without(texts: Iterable[str], contents: list[str]) -> Iterator[str]:
    """The texts cut at every occurrence of the given tokens, which are left out: BPE learns no merges
    across an added token, and none inside it."""
    pattern = re.compile("|".join(map(re.escape, sorted(contents, key=len, reverse=True)))) if contents else None
    for text in texts:
        yield from (pattern.split(text) if pattern else [text])


def around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer`` adds before and after a text when asked for special tokens (a Llama
    tokenizer's BOS; none for SmolLM2's)."""
    bare = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a", add_special_tokens=True).input_ids
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def train_tokenizer(texts: Iterable[str], vocab: int, target_tokenizer):
    """A byte-level BPE of at most ``vocab`` tokens (fewer when the text has fewer merges to learn)
    trained on ``texts``, with the target's added tokens, special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    added = added_tokens(target_tokenizer)
    special = [content for content, is_special in added if is_special]
    plain = [content for content, is_special in added if not is_special]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(without(texts, [content for content, _ in added]), trainer)
    if plain:  # added tokens the target does not treat as special (e.g. a reasoning model's <think>)
        tok.add_tokens([AddedToken(content, normalized=False, special=False) for content in plain])
    before, after = around(target_tokenizer)
    if before or after:
        contents = target_tokenizer.convert_ids_to_tokens(before + after)
        ids = [(c, tok.token_to_id(c)) for c in dict.fromkeys(contents)]
        pre, post = contents[: len(before)], contents[len(before) :]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*pre, "$A", *post]),
            pair=" ".join([*pre, "$A", *post, *pre, "$B:1", *post]),
            special_tokens=ids,
        )
    t = target_tokenizer
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=t.bos_token,
        eos_token=t.eos_token,
        pad_token=t.pad_token,
        unk_token=t.unk_token,
        clean_up_tokenization_spaces=False,
        model_max_length=t.model_max_length,
        padding_side=t.padding_side,
        chat_template=t.chat_template,
    )


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes of each id's text: an added token's content, a byte-level token's bytes (a token may
    hold part of a character), else (another kind of tokenizer) the id decoded alone."""
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    table = byte_of()
    found = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in added:
            found.append(added[i].encode())
        elif token is not None and all(c in table for c in token):
            found.append(bytes(table[c] for c in token))
        else:
            found.append(tokenizer.decode([i], clean_up_tokenization_spaces=False).encode())
    return found


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map the same strings to the same ids."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()
