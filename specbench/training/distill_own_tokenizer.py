"""`specbench distill --tokenizer-vocab N`: a draft with its own tokenizer, for drafting across vocabularies.

After the target has written its answers (distill's generate phase, unchanged):

1. tokenizer: a byte-level BPE of N tokens (training/draft_tokenizer.py) is trained on the stored
   prompts and answers, less the held-out ones, and on --source files in distill's seeded order (as
   many characters of them as the answers hold, or about 4 a token of --teacher-tokens if that is
   more), less any file that shares text with Spec-Bench's or MT-Bench's questions
   (training/held_out.py). It is kept in ``DIR/tokenizer`` and copied beside the checkpoint. An
   --init draft that already has a tokenizer of its own (not the target's) keeps it instead.
2. student: a small Llama whose vocabulary is that tokenizer's. Each token's embedding starts as the
   mean of the target's embeddings (PCA-projected to the draft's width, as a same-tokenizer draft
   starts) of that token's text as the target tokenizes it; with --init a draft of the target's
   tokenizer, the mean of that draft's own embeddings, its layers kept. Tokens whose bytes are no
   text (part of a character) keep the random init.

   The target's next-token distributions are over its own tokens, and a draft token may be several
   target tokens or part of one, so they cannot be distilled across vocabularies position by
   position (a KL loss needs one vocabulary). The student learns the target's *text* instead: next-token
   cross-entropy on the target's answers (greedy and, a --sampled-fraction of them, sampled at T=1)
   re-tokenized with the draft's tokenizer, the prompt as context only; with --teacher-tokens, as many
   of the draft's tokens of --source text as well, read the same way (the target labels nothing).
   Training resumes from its saved step like the rest of distill.

Held out: every 16th greedy answer, as for a same-tokenizer draft. At each of its positions in the
draft's tokens, the draft's greedy token is scored two ways: its text begins the target's
remaining answer (``held_out_greedy_agreement``, text agreement: a draft token that the target's
text confirms, the unit of drafting by text), and it is the re-tokenized answer's next token
(``held_out_token_agreement``). Both are saved in distill.json with the answers' target tokens per
draft token.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import LoadedModel
from specbench.models.student import Example, collate, kd_loss, labelled_logits
from specbench.training.distill import (
    DistillConfig,
    TrainingProgress,
    answer_shards,
    distill,
    draft_config,
    optimise,
    pca_embeddings,
    save_draft,
)
from specbench.training.draft_tokenizer import same_vocabulary, token_bytes, train_tokenizer
from specbench.training.held_out import held_out_fingerprints, overlaps
from specbench.training.stored import TOKENIZER_DIR
from specbench.workloads.sources import source_files

log = logging.getLogger("specbench")

TRAINED = "trained.json"  # in it: what it was trained for
CHARS_PER_TOKEN = 4  # about, in Python source: the characters the tokenizer reads for --teacher-tokens


@dataclass
class StoredAnswer:
    prompt: str  # as the target read it, chat template and special tokens included
    answer: str  # through its stop token
    held_out: bool
    target_tokens: int  # the answer's length in the target's tokens


def stored_answers(cfg: DistillConfig, target_tokenizer) -> list[StoredAnswer]:
    """The generate phase's prompts and answers as text, each marked held out as load_examples marks it."""
    found = []

    def text(ids: list[int]) -> str:
        return target_tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for _, docs, held in answer_shards(cfg.out, cfg.sampled_fraction):
        for doc, h in zip(docs, held, strict=True):
            ids, n = doc["ids"].tolist(), doc["prompt_len"]
            # An answer cut at --generate-new-tokens may end inside a character.
            answer = text(ids[n:]).rstrip("\ufffd")
            found.append(StoredAnswer(text(ids[:n]), answer, h, len(ids) - n))
    return found


def source_texts(cfg: DistillConfig) -> Iterator[str]:
    """The --source files in distill's seeded order (token_stream's), less any that shares text with
    an evaluation's questions."""
    held = held_out_fingerprints()
    order = list(source_files(cfg.sources))
    random.Random(cfg.seed).shuffle(order)
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if overlaps(text, held):
            log.info("%s shares text with Spec-Bench's or MT-Bench's questions: left out", path)
            continue
        yield text


def tokenizer_texts(cfg: DistillConfig, answers: list[StoredAnswer]) -> Iterator[str]:
    """What the tokenizer is trained on: the answers that are not held out, with their prompts, then
    --source text of as many characters (or about CHARS_PER_TOKEN a token of --teacher-tokens)."""
    read = 0
    for a in answers:
        if not a.held_out:
            read += len(a.prompt) + len(a.answer)
            yield a.prompt + a.answer
    budget, taken = max(read, CHARS_PER_TOKEN * cfg.teacher_tokens), 0
    for text in source_texts(cfg):
        if taken >= budget:
            break
        taken += len(text)
        yield text
    log.info("the draft's tokenizer trains on %d characters of answers and %d of --source", read, taken)


def init_tokenizer(cfg: DistillConfig, target: LoadedModel):
    """The tokenizer of --init when it is a draft's own (not the target's), else None."""
    from transformers import AutoTokenizer

    if not cfg.goes_on:
        return None
    tokenizer = AutoTokenizer.from_pretrained(cfg.init)
    return None if same_vocabulary(tokenizer, target.tokenizer) else tokenizer


def own_tokenizer(cfg: DistillConfig, target: LoadedModel, answers: list[StoredAnswer]):
    """Train the draft's tokenizer into DIR/tokenizer (or keep the one there); returns it as loaded from there."""
    from transformers import AutoTokenizer

    where = cfg.out / TOKENIZER_DIR
    if (where / "tokenizer.json").is_file():
        trained = json.loads((where / TRAINED).read_text()) if (where / TRAINED).is_file() else {}
        if trained.get("tokenizer_vocab") != cfg.tokenizer_vocab:
            raise SpecbenchError(
                f"{where} holds a tokenizer trained for --tokenizer-vocab {trained.get('tokenizer_vocab')}: run with "
                "that again, or give another --out"
            )
        yield TrainingProgress("tokenizer", 1, 1)
        return AutoTokenizer.from_pretrained(where)
    yield TrainingProgress("tokenizer", 0, 1)
    tokenizer = init_tokenizer(cfg, target)
    kept = tokenizer is not None
    if kept:
        log.info("--init %s has its own tokenizer (%d tokens): the draft keeps it", cfg.init, len(tokenizer))
    else:
        tokenizer = train_tokenizer(tokenizer_texts(cfg, answers), cfg.tokenizer_vocab, target.tokenizer)
    tmp = where.with_name(where.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    trained = {
        "tokenizer_vocab": cfg.tokenizer_vocab,
        "tokens": len(tokenizer),
        "kept_from": cfg.init if kept else None,  # --init's own tokenizer, or None: trained here
    }
    (tmp / TRAINED).write_text(json.dumps(trained) + "\n")
    os.replace(tmp, where)
    yield TrainingProgress("tokenizer", 1, 1)
    return AutoTokenizer.from_pretrained(where)


def mapped_rows(tokenizer, target_tokenizer, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i: the mean of ``embeddings`` (rows indexed by the target's ids) over the target's ids of
    token i's text; and which rows were found (a token whose bytes are no text has none)."""
    texts = []
    for raw in token_bytes(tokenizer):
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            texts.append("")
    rows = torch.zeros(len(texts), embeddings.shape[1])
    found = torch.zeros(len(texts), dtype=torch.bool)
    for i, ids in enumerate(target_tokenizer(texts, add_special_tokens=False).input_ids):
        ids = [t for t in ids if t < len(embeddings)]
        if texts[i] and ids:
            rows[i], found[i] = embeddings[ids].float().mean(0), True
    return rows, found


def mapped_id(target_id, target_tokenizer, tokenizer):
    """A target's special id (or list of them) as the draft's tokenizer numbers the same token."""
    if target_id is None:
        return None
    if isinstance(target_id, list):
        return [i for i in (mapped_id(t, target_tokenizer, tokenizer) for t in target_id) if i is not None] or None
    token = target_tokenizer.convert_ids_to_tokens(target_id)
    return tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None


def own_student(cfg: DistillConfig, target: LoadedModel, tokenizer):
    """The student over ``tokenizer``'s vocabulary: an --init draft of it as it is; one of the target's
    tokenizer with its layers kept and its embeddings mapped; else a new Llama from the target's
    PCA-projected embeddings (``pca``) or transformers' init (``random``)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.goes_on:
        student = AutoModelForCausalLM.from_pretrained(cfg.init, dtype=torch.float32)
        if init_tokenizer(cfg, target) is not None:  # the draft's own tokenizer, kept by own_tokenizer
            return student
        tied = student.config.tie_word_embeddings
        sources = [student.get_input_embeddings().weight.detach().clone()]
        if not tied:
            sources.append(student.get_output_embeddings().weight.detach().clone())
        student.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        layers = [student.get_input_embeddings().weight] + ([] if tied else [student.get_output_embeddings().weight])
    else:
        config = draft_config(cfg, target)
        config.vocab_size = len(tokenizer)
        student = LlamaForCausalLM(config)
        layers = [student.get_input_embeddings().weight]
        sources = []
        if cfg.init == "pca":
            embeddings = target.model.get_input_embeddings().weight.detach()[: target.width]
            sources = [pca_embeddings(embeddings, cfg.hidden_size)]
    with torch.no_grad():
        for layer, source in zip(layers, sources, strict=False):
            rows, found = mapped_rows(tokenizer, target.tokenizer, source)
            layer[found] = rows[found].to(layer.dtype)
    t = target.model.config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = mapped_id(getattr(t, key, None), target.tokenizer, tokenizer)
        setattr(student.config, key, value)
        if student.generation_config is not None:
            setattr(student.generation_config, key, value)
    return student


def answer_example(tokenizer, answer: StoredAnswer) -> Example | None:
    """The answer in the draft's tokens after its prompt, labelled with its own next tokens (a one-hot
    'distribution': kd_loss is then the cross-entropy); None if it has no token."""
    # The decoded prompt holds whatever special tokens the target read: none are added.
    prompt = tokenizer(answer.prompt, add_special_tokens=False).input_ids
    tokens = tokenizer(answer.answer, add_special_tokens=False).input_ids
    if not prompt or not tokens:
        return None
    return one_hot(torch.tensor(prompt + tokens), len(prompt) - 1)


def one_hot(ids: torch.Tensor, start: int) -> Example:
    """An example that learns ``ids`` from position ``start`` on: each position's label is the next id."""
    labels = ids[start + 1 :].long()
    return Example(ids.long(), start, torch.zeros(len(labels), 1), labels.unsqueeze(1))


def source_examples(cfg: DistillConfig, tokenizer) -> list[Example]:
    """--teacher-tokens of --source text in the draft's tokens, in --seq-len sequences (each file closed by EOS)."""
    if not cfg.teacher_tokens:
        return []
    wanted, ids = cfg.teacher_tokens // cfg.seq_len * cfg.seq_len, []
    for text in source_texts(cfg):
        ids += tokenizer(text, add_special_tokens=False).input_ids
        ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if len(ids) >= wanted:
            break
    if len(ids) < wanted:
        raise SpecbenchError(
            f"the sources hold fewer than {wanted} tokens of the draft's tokenizer: lower --teacher-tokens or add --source"
        )
    return [one_hot(row, 0) for row in torch.tensor(ids[:wanted]).view(-1, cfg.seq_len)]


def text_agreement(student, held_out: list[Example], table: list[bytes], special: set[int], batch: int):
    """(text agreement, token agreement) of the student's greedy tokens over the held-out positions,
    or None without any: text, its token's bytes begin the rest of the answer (without running into
    a special token; at a special token, only that token); token, it is the answer's next token."""
    if not held_out:
        return None
    text_hits = token_hits = total = 0
    student.eval()
    with torch.inference_mode():
        for i in range(0, len(held_out), batch):
            chunk = held_out[i : i + batch]
            b = collate(chunk)
            guesses = labelled_logits(student, b).argmax(-1).tolist()
            labels = b["top_idx"][b["labelled"]][:, 0].tolist()
            at = 0
            for e in chunk:
                truth, guessed = labels[at : at + len(e.top_idx)], guesses[at : at + len(e.top_idx)]
                at += len(truth)
                rest = b"".join(table[t] for t in truth)
                # Byte offsets of each position, and of the next special token from it on.
                starts = [0]
                for t in truth:
                    starts.append(starts[-1] + len(table[t]))
                stops, stop = [0] * len(truth), len(rest)
                for j in reversed(range(len(truth))):
                    stop = starts[j] if truth[j] in special else stop
                    stops[j] = stop
                for j, (g, t) in enumerate(zip(guessed, truth, strict=True)):
                    token_hits += g == t
                    if g in special or t in special:
                        text_hits += g == t
                    else:
                        end = starts[j] + len(table[g])
                        text_hits += bool(table[g]) and end <= stops[j] and rest.startswith(table[g], starts[j])
                total += len(truth)
    student.train()
    return text_hits / total, token_hits / total


def train_own_vocabulary(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    """The tokenizer phase, then the student's (resumable), then the checkpoint with its tokenizer."""
    answers = stored_answers(cfg, target.tokenizer)
    tokenizer = yield from own_tokenizer(cfg, target, answers)
    train, held_out, target_tokens = [], [], 0
    for answer in answers:
        example = answer_example(tokenizer, answer)
        if example is not None and answer.held_out:
            held_out.append(example)
            target_tokens += answer.target_tokens
        elif example is not None:
            train.append(example)
    examples = source_examples(cfg, tokenizer) + train * cfg.generated_repeats
    if not examples:
        raise SpecbenchError(f"no training text in {cfg.out}: raise --generate-prompts or --teacher-tokens")
    student = own_student(cfg, target, tokenizer)
    table, special = token_bytes(tokenizer), set(tokenizer.added_tokens_decoder)

    def batch_loss(rows: list[int]) -> torch.Tensor:
        b = collate([examples[i] for i in rows])
        return kd_loss(labelled_logits(student, b), b["top_logp"][b["labelled"]], b["top_idx"][b["labelled"]])

    def evaluate() -> tuple[float, ...]:
        return text_agreement(student, held_out, table, special, cfg.batch) or ()

    held = yield from optimise(cfg, student, [len(e.ids) for e in examples], batch_loss, evaluate)
    draft_tokens = sum(len(e.top_idx) for e in held_out)
    save_draft(
        student,
        target,
        cfg,
        held[0] if held else None,
        None,
        tokenizer=tokenizer,
        tokenizer_tokens=len(tokenizer),
        held_out_token_agreement=held[1] if held else None,
        held_out_draft_tokens=draft_tokens,
        held_out_target_tokens_per_draft_token=target_tokens / draft_tokens if draft_tokens else None,
    )


def distill_own_vocabulary(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    """`specbench distill --tokenizer-vocab N`: distill's generate phase, then train_own_vocabulary."""
    yield from distill(cfg, target, train=train_own_vocabulary)
