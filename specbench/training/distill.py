"""Distil a small draft model from a target that has none.

Three resumable phases, all seeded:
1. teacher: the target reads Python source that is already on the machine (the standard
   library; never an evaluation set) and its top-k next-token distribution is stored in shards
   (--teacher-tokens; 0 skips it, as chat data wants);
2. generate: the target answers the prompts of --data (training/distill_data.py: ShareGPT chat,
   HumanEval-shaped function stubs from those sources, a user's file, or a weighted mixture),
   asked the way the evaluation asks; its top-k distribution at every answer position is kept as
   it generates. This is the text the draft will be asked to predict, so it weighs most;
3. student: a small Llama sharing the target's tokenizer learns those distributions (a KL loss
   against the renormalised top-k), starting from a PCA projection of the target's embeddings
   or from an earlier draft. With --tokenizer-vocab N the draft gets a tokenizer of its own and
   learns the answers' text instead (training/distill_own_tokenizer.py).

The result is a plain transformers checkpoint in half precision that ``--draft DIR`` loads.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specbench.core.errors import SpecbenchError
from specbench.core.files import replacing
from specbench.engines import llamacpp
from specbench.models.load import LoadedModel
from specbench.models.names import HUB_ID, speculator_dir
from specbench.models.student import Example, collate, kd_loss, labelled_logits, save_checkpoint
from specbench.training import teacher
from specbench.training.distill_data import answered_prompts, parse_data
from specbench.training.stored import FEATURES, check_stored, record_settings
from specbench.workloads.sources import source_files

log = logging.getLogger("specbench")

SHARD_SEQUENCES = 64
HELD_OUT_EVERY = 16  # of the greedy answers (counted among all answers), this one in so many is held out
MIN_TOKENIZER_VOCAB = 300  # a byte-level tokenizer's 256 bytes, special tokens and some merges
KINDS = {"draft": "a draft", "eagle": "an EAGLE head"}  # what --kind trains
TRAIN_DTYPES = ("float32", "bfloat16")


@dataclass
class DistillConfig:
    out: Path
    target: str = "smollm2-135m"
    hidden_size: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 768
    # A draft: "pca" (project the target's embeddings), "random" (transformers' init) or a draft's directory.
    # A head: "pca" or "random" start afresh (distill_eagle.new_head); a head's directory or alias goes on training.
    init: str = "pca"
    draft_vocab: int = 0  # the drafter's vocabulary: the ids the teacher ranks first most often (0: all of them)
    # A draft with its own tokenizer of this many tokens (training/distill_own_tokenizer.py); 0: the target's.
    tokenizer_vocab: int = 0
    seq_len: int = 256
    teacher_tokens: int = 300_000
    teacher_batch: int = 8
    top_k: int = 32
    epochs: float = 3.0
    batch: int = 8
    lr: float = 2e-3
    # The products of the training forwards: float32, or bfloat16 under autocast (the weights, the
    # optimiser and the loss's softmax stay float32), which CPUs with bfloat16 units and GPUs run faster.
    train_dtype: str = "float32"
    warmup_steps: int = 30
    save_every: int = 50
    eval_every: int = 200
    seed: int = 0
    sources: list[str] = field(default_factory=lambda: [sysconfig.get_paths()["stdlib"]])
    # Conversations the target writes itself: prompts of --data (training/distill_data.py), sent through the
    # chat template as the evaluation's prompts are (never the evaluation's own questions).
    data: str = "humaneval"
    max_prompt_tokens: int = 1024
    teacher_engine: str = "torch"  # who writes the answers (training/teacher.py): torch, llama-cpp or vllm
    teacher_gguf: str | None = None  # llama-cpp: the GGUF it serves (default: the target's own)
    llama_server: str | None = None  # llama-cpp: the llama-server binary (default: engines/llamacpp.find_server)
    generate_prompts: int = 1024
    generate_new_tokens: int = 128
    generate_batch: int = 64
    sampled_fraction: float = 0.25
    generated_repeats: int = 4  # in-distribution text, so it counts this many times per epoch
    # Earlier distill runs of the same target whose answers are trained on beside this run's own; the
    # prompts they answered are not drawn again, and what they held out stays held out.
    answers_from: list[str] = field(default_factory=list)
    kind: str = "draft"  # "draft": a small model; "eagle": an EAGLE-3 head (training/distill_eagle.py)
    ttt_steps: int = 3  # eagle: steps of EAGLE-3's training-time test (the head reads its own outputs)
    head_intermediate: int = 0  # eagle: the head's MLP width (0: the target's)

    @property
    def goes_on(self) -> bool:
        """Whether training starts from --init's checkpoint (a draft's, or for --kind eagle a head's)."""
        return self.init not in ("pca", "random")

    @property
    def trains_head(self) -> bool:
        """Whether it trains an EAGLE head (training/distill_eagle.py) rather than a draft."""
        return self.kind != "draft"

    def validate(self) -> None:
        if self.goes_on and self.trains_head:
            try:
                speculator_dir(self.init)
            except SpecbenchError:
                if HUB_ID.match(self.init):  # the hub's own answer (offline, gated, not found) says more
                    raise
                raise SpecbenchError(
                    f"--init {self.init}: for --kind eagle use pca, random, or an EAGLE head's directory, alias or "
                    "hub id to go on training"
                ) from None
        elif self.goes_on and not (Path(self.init) / "config.json").is_file():
            raise SpecbenchError(
                f"--init {self.init}: use pca, random, or the directory of a draft checkpoint to go on training"
            )
        if self.draft_vocab < 0:
            raise SpecbenchError("--draft-vocab must be at least 0 (0: every id the target ranks first)")
        if 0 < self.tokenizer_vocab < MIN_TOKENIZER_VOCAB or self.tokenizer_vocab < 0:
            raise SpecbenchError(
                f"--tokenizer-vocab must be 0 (the target's tokenizer) or at least {MIN_TOKENIZER_VOCAB}: 256 bytes, "
                "the target's special tokens and merges"
            )
        if self.tokenizer_vocab and (self.trains_head or self.draft_vocab):
            raise SpecbenchError(
                "--tokenizer-vocab gives a draft its own tokenizer: use it with --kind draft and without --draft-vocab "
                "(a shortlist of the target's ids)"
            )
        if self.tokenizer_vocab and not (self.generate_prompts or self.teacher_tokens):
            raise SpecbenchError("--tokenizer-vocab: the draft learns the target's answers; give --generate-prompts")
        if self.kind not in KINDS:
            raise SpecbenchError(f"--kind {self.kind}: use draft or eagle")
        if self.train_dtype not in TRAIN_DTYPES:
            raise SpecbenchError(f"--train-dtype {self.train_dtype}: use {' or '.join(TRAIN_DTYPES)}")
        if self.top_k < 1:
            raise SpecbenchError("--top-k must be at least 1: the teacher's probabilities kept per position")
        counts = ("batch", "teacher_batch", "generate_batch", "heads", "kv_heads", "warmup_steps", "save_every",
                  "eval_every")  # fmt: skip
        for name in counts:  # each divides or steps a range, so 0 would fail only once its phase is reached
            if getattr(self, name) < 1:
                raise SpecbenchError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.lr < math.inf:  # 0 is allowed: the weights stay as they start (a test of the start uses it)
            raise SpecbenchError(f"--lr {self.lr}: the learning rate must be a finite number, at least 0")
        if self.seq_len < 2:
            # A draft learns each position's next token from the tokens before it: one token has none
            # before it, and a draft of its own tokenizer no next token to learn at all.
            raise SpecbenchError(f"--seq-len {self.seq_len}: use at least 2, a token to learn from and the next one")
        if self.ttt_steps < 1 or self.head_intermediate < 0:
            raise SpecbenchError("--ttt-steps must be at least 1 and --head-intermediate at least 0")
        existing = self.out / "config.json"
        if existing.is_file():
            head = any("eagle" in a.lower() for a in json.loads(existing.read_text()).get("architectures") or [])
            if head != self.trains_head:
                raise SpecbenchError(
                    f"--out {self.out} holds {'an EAGLE head' if head else 'a draft'}, and --kind {self.kind} trains "
                    f"{KINDS[self.kind]}: give another --out"
                )
        if self.answers_from and self.tokenizer_vocab:
            raise SpecbenchError(
                "--answers-from trains on earlier runs' answers in the target's tokens; a draft of its own tokenizer "
                "(--tokenizer-vocab) reads only its own run's: leave one of them out"
            )
        for run in map(Path, self.answers_from):
            if run.resolve() == self.out.resolve():
                raise SpecbenchError(f"--answers-from {run}: that is --out itself; name earlier runs' directories")
            if not (run / "distill.json").is_file() or not any((run / "generated").glob("*.pt")):
                raise SpecbenchError(
                    f"--answers-from {run}: no finished distill run there (distill.json and generated/*.pt); "
                    "give the --out of a run that generated answers"
                )
            earlier = json.loads((run / "distill.json").read_text()).get("target")
            if earlier != self.target:
                raise SpecbenchError(
                    f"--answers-from {run}: its answers are {earlier}'s, not {self.target}'s: give runs of the same target"
                )
        if not 0 <= self.sampled_fraction <= 1:
            raise SpecbenchError("--sampled-fraction must lie between 0 and 1")
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise SpecbenchError("--hidden-size must divide by --heads, and --heads by --kv-heads")
        if (
            self.hidden_size <= 0
            or self.layers <= 0
            or 0 < self.teacher_tokens < self.seq_len
            or not 0 < self.epochs < math.inf
        ):
            raise SpecbenchError(
                "sizes and --epochs must be positive (--epochs finite), --teacher-tokens 0 or at least --seq-len"
            )
        if self.max_prompt_tokens < 1 or self.generate_prompts < 0:
            raise SpecbenchError("--max-prompt-tokens must be positive and --generate-prompts at least 0")
        parse_data(self.data)
        if self.teacher_engine not in teacher.ENGINES:
            raise SpecbenchError(f"--teacher-engine {self.teacher_engine}: use {' or '.join(teacher.ENGINES)}")
        teacher.check_installed(self.teacher_engine)
        if self.teacher_gguf and not Path(self.teacher_gguf).expanduser().is_file():
            raise SpecbenchError(f"--teacher-gguf {self.teacher_gguf}: no such file; give the target's .gguf")
        check_stored(self.out, asdict(self))


@dataclass
class TrainingProgress:
    phase: str  # "teacher:<shard dir>", "generate", "student"; for a head "features" and "head"
    done: int
    total: int
    loss: float | None = None
    agreement: float | None = None  # the student's top-1 agreement with held-out greedy answers
    later: tuple[float, ...] = ()  # a head's: the same at training-time test steps 1, 2, ...


def token_stream(tokenizer, files: list[Path], seed: int) -> Iterator[int]:
    """Token ids of the files in a seeded random order, each file closed by EOS (when the tokenizer has one)."""
    order = list(files)
    random.Random(seed).shuffle(order)
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from tokenizer(text).input_ids
        if tokenizer.eos_token_id is not None:  # a tokenizer without one runs the files together
            yield tokenizer.eos_token_id


def is_sampled(sampled_fraction: float, batch: int) -> bool:
    """Whether answer batch ``batch`` is sampled at T=1: a ``sampled_fraction`` share, spread evenly."""
    return math.floor((batch + 1) * sampled_fraction) > math.floor(batch * sampled_fraction)


def answer_runs(cfg: DistillConfig) -> list[tuple[Path, float]]:
    """The runs whose answers this one trains on, each with the share of its batches it sampled:
    this run's own, then --answers-from's."""
    earlier = [(Path(run), json.loads((Path(run) / "distill.json").read_text())) for run in cfg.answers_from]
    fraction = DistillConfig.sampled_fraction  # a recipe written before the option had the default's
    return [(cfg.out, cfg.sampled_fraction)] + [(run, meta.get("sampled_fraction", fraction)) for run, meta in earlier]


def answer_shards(run: Path, sampled_fraction: float) -> Iterator[tuple[Path, list[dict], list[bool]]]:
    """Each answer shard of a distill run, in order, with its answers and which of them the run holds
    out: every HELD_OUT_EVERY-th answer, counted over the run, if its batch was greedy."""
    seen = 0
    for path in sorted((run / "generated").glob("*.pt")):
        greedy = not is_sampled(sampled_fraction, int(path.stem))
        docs = torch.load(path)
        yield path, docs, [greedy and (seen + i) % HELD_OUT_EVERY == 0 for i in range(len(docs))]
        seen += len(docs)


def prompt_of(doc: dict) -> tuple[int, ...]:
    """A stored answer's prompt ids: two answers to one prompt are one greedy answer."""
    return tuple(doc["ids"][: doc["prompt_len"]].tolist())


def answered_elsewhere(cfg: DistillConfig) -> set[tuple[int, ...]]:
    """The prompts --answers-from's runs answered, which this run does not draw again."""
    return {
        prompt_of(doc)
        for run, fraction in answer_runs(cfg)[1:]
        for _, docs, _ in answer_shards(run, fraction)
        for doc in docs
    }


def generated_shards(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    """The target answers the chat prompts, a batch per shard; existing shards are kept.

    Each answer is stored with the target's top-k log-probabilities at every answer position,
    recorded while it generates (training/teacher.py: by the torch target or by llama.cpp serving the same
    weights), so these tokens need no second labelling pass. A share of the batches is sampled at
    T=1, the rest greedy, as the default benchmark is.
    """
    out_dir = cfg.out / "generated"
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen, prompts = answered_prompts(
        target.tokenizer,
        cfg.data,
        cfg.generate_prompts,
        cfg.sources,
        cfg.seed,
        cfg.max_prompt_tokens,
        answered_elsewhere(cfg),
    )
    # Prompts of similar length share a batch, so little compute goes on left padding.
    order = sorted(range(len(chosen)), key=lambda i: (len(prompts[i]), i))
    batches = [order[i : i + cfg.generate_batch] for i in range(0, len(order), cfg.generate_batch)]
    paths = [out_dir / f"{b:04d}.pt" for b in range(len(batches))]
    if all(path.exists() for path in paths):
        yield TrainingProgress("generate", len(chosen), len(chosen))
        return
    longest = max(map(len, prompts))
    checked = cfg.teacher_engine == "torch"  # another engine's answers are checked on its first shard
    dropped = written = 0
    with answering(cfg, target, longest) as answer:
        for b, rows in enumerate(batches):
            done = min((b + 1) * cfg.generate_batch, len(chosen))
            if paths[b].exists():
                yield TrainingProgress("generate", done, len(chosen))
                continue
            asked = [prompts[i] for i in rows]
            answers = answer(asked, is_sampled(cfg.sampled_fraction, b), cfg.seed * 100_003 + b)
            if not checked:
                teacher.same_weights(cfg.teacher_engine, cfg.target, target, asked, answers, cfg.out / "generated")
                checked = True
            dropped += sum(a.dropped for a in answers)
            written += sum(len(a.tokens) for a in answers)
            docs = [
                {
                    "ids": torch.tensor(asked[r] + a.tokens).int(),
                    "prompt_len": len(asked[r]),
                    "top_logp": a.top_logp,
                    "top_idx": a.top_idx,
                    "source": chosen[index].source,
                }
                for r, (index, a) in enumerate(zip(rows, answers, strict=True))
            ]
            with replacing(paths[b]) as tmp:
                torch.save(docs, tmp)
            yield TrainingProgress("generate", done, len(chosen))
    if dropped:
        log.info(
            "%s gave no log-probabilities for %d answer tokens inside multi-byte characters: the answers end "
            "before them (%d tokens kept)",
            cfg.teacher_engine,
            dropped,
            written,
        )
    summary = answers_summary(out_dir, paths)
    log.info(
        "the target's answers: %d to %d prompts, %d answer tokens (and %d of prompts), %.0f MB in %s",
        summary["answers"],
        len(chosen),
        summary["answer_tokens"],
        summary["prompt_tokens"],
        summary["bytes"] / 1e6,
        out_dir,
    )


def answers_summary(out_dir: Path, paths: list[Path]) -> dict:
    """What the generate phase stored (answers, tokens, bytes), also written to ``out_dir``/answers.json."""
    answers = answer_tokens = prompt_tokens = 0
    for path in paths:
        for doc in torch.load(path):
            answers += 1
            prompt_tokens += doc["prompt_len"]
            answer_tokens += len(doc["ids"]) - doc["prompt_len"]
    summary = {
        "answers": answers,
        "answer_tokens": answer_tokens,
        "prompt_tokens": prompt_tokens,
        "bytes": sum(path.stat().st_size for path in paths),
    }
    (out_dir / "answers.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@contextmanager
def answering(cfg: DistillConfig, target: LoadedModel, longest: int) -> Iterator[teacher.Answerer]:
    """The --teacher-engine that answers the prompts (the longest of ``longest`` tokens), open for the phase."""
    if cfg.teacher_engine == "torch":
        yield teacher.torch_answers(target, cfg.generate_new_tokens, cfg.top_k)
        return
    if cfg.teacher_engine == "vllm":
        context = longest + cfg.generate_new_tokens
        with teacher.vllm_answers(
            target, cfg.generate_batch, context, cfg.generate_new_tokens, cfg.top_k, cfg.seed
        ) as answer:
            yield answer
        return
    server = llamacpp.find_server(cfg.llama_server)
    gguf = teacher.gguf_of(cfg.teacher_gguf, cfg.target, target, server)
    log.info("llama.cpp's llama-server answers the prompts from %s", gguf)
    context = longest + cfg.generate_new_tokens + llamacpp.SLACK
    with teacher.llama_cpp_answers(
        target, gguf, server, cfg.generate_batch, context, cfg.generate_new_tokens, cfg.top_k, cfg.out
    ) as answer:
        yield answer


def teacher_shards(
    cfg: DistillConfig, target: LoadedModel, stream: Iterator[int], n_tokens: int, shard_dir: Path
) -> Iterator[TrainingProgress]:
    """Store the target's top-k log-probabilities over a token stream; existing shards are kept."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    n_seqs = n_tokens // cfg.seq_len
    n_shards = math.ceil(n_seqs / SHARD_SEQUENCES)
    phase = f"teacher:{shard_dir.name}"
    for shard in range(n_shards):
        path = shard_dir / f"{shard:04d}.pt"
        count = min(SHARD_SEQUENCES, n_seqs - shard * SHARD_SEQUENCES)
        ids = [next(stream, None) for _ in range(count * cfg.seq_len)]
        if None in ids:
            raise SpecbenchError(
                f"the sources hold fewer than {n_tokens} tokens: lower --teacher-tokens or add --source"
            )
        if path.exists():
            yield TrainingProgress(phase, shard * SHARD_SEQUENCES + count, n_seqs)
            continue
        ids = torch.tensor(ids).view(count, cfg.seq_len)
        top_logp, top_idx = [], []
        with torch.inference_mode():
            for start in range(0, count, cfg.teacher_batch):
                batch = ids[start : start + cfg.teacher_batch].to(target.model.device)
                logp = target.model(input_ids=batch).logits.float().log_softmax(-1)
                values, indices = logp.topk(cfg.top_k, dim=-1)
                top_logp.append(values.half().cpu())
                top_idx.append(indices.int().cpu())
                yield TrainingProgress(phase, shard * SHARD_SEQUENCES + start + len(batch), n_seqs)
        with replacing(path) as tmp:
            torch.save({"ids": ids.int(), "top_logp": torch.cat(top_logp), "top_idx": torch.cat(top_idx)}, tmp)


def draft_config(cfg: DistillConfig, target: LoadedModel):
    from transformers import LlamaConfig

    t = target.model.config
    return LlamaConfig(
        vocab_size=target.width,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters=getattr(t, "rope_parameters", None),
        rms_norm_eps=t.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        pad_token_id=getattr(t, "pad_token_id", None),
    )


def pca_embeddings(target_embeddings: torch.Tensor, width: int) -> torch.Tensor:
    """The target's token embeddings projected on their top ``width`` principal directions.

    Rescaled to the usual init's standard deviation, so the draft starts with a vocabulary
    geometry the target learned instead of noise.
    """
    centred = target_embeddings.float() - target_embeddings.float().mean(0)
    _, _, v = torch.pca_lowrank(centred, q=width, center=False, niter=4)
    projected = centred @ v[:, :width]
    return projected / projected.std() * 0.02 * math.sqrt(width / 64)


def new_student(cfg: DistillConfig, target: LoadedModel):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.goes_on:  # a draft checkpoint to go on training
        student = AutoModelForCausalLM.from_pretrained(cfg.init, dtype=torch.float32)
        if student.get_output_embeddings().weight.shape[0] < target.width:
            raise SpecbenchError(
                f"--init {cfg.init}: its vocabulary is narrower than the target's; start from pca instead"
            )
        return student
    student = LlamaForCausalLM(draft_config(cfg, target))
    if cfg.init == "pca":
        embeddings = target.model.get_input_embeddings().weight.detach()[: target.width]
        with torch.no_grad():
            student.get_input_embeddings().weight.copy_(pca_embeddings(embeddings, cfg.hidden_size))
    return student


def data_shards(cfg: DistillConfig) -> list[Path]:
    """The stored teacher and generated shards, in the order training reads them (this run's, then
    --answers-from's answers)."""
    own = [path for name in ("teacher", "generated") for path in sorted((cfg.out / name).glob("*.pt"))]
    return own + [path for run in cfg.answers_from for path in sorted((Path(run) / "generated").glob("*.pt"))]


def feature_path(shard: Path) -> Path:
    """Where a head's features of a teacher or generated shard are stored: in its own run's
    directory, so a later run that trains on that run's answers reads them there."""
    return shard.parent.parent / FEATURES / shard.parent.name / shard.name


def shard_sequences(path: Path) -> list[torch.Tensor]:
    """The token ids of each sequence in a teacher or generated shard."""
    shard = torch.load(path)
    return list(shard["ids"]) if isinstance(shard, dict) else [doc["ids"] for doc in shard]


def load_examples(cfg: DistillConfig, features: bool = False) -> tuple[list[Example], list[Example]]:
    """Training examples (the target's answers repeated ``generated_repeats`` times) and a
    held-out set: every 16th answer if it is greedy, on which top-1 agreement estimates greedy alpha.
    With ``features``, each example carries the features stored for it (feature_path).

    The answers are this run's and --answers-from's. Each run's held-out answers stay held out, and
    an answer to a prompt answered before, or held out by any run, is not trained on: runs drawn
    with other seeds share prompts, and a greedy answer to one prompt is the same answer."""

    def stored(path: Path, count: int) -> list:
        return torch.load(feature_path(path)) if features else [None] * count

    source = []
    for path in sorted((cfg.out / "teacher").glob("*.pt")):
        shard = torch.load(path)
        source += [
            Example(ids, 0, logp, idx, features=f)
            for ids, logp, idx, f in zip(
                shard["ids"], shard["top_logp"], shard["top_idx"], stored(path, len(shard["ids"])), strict=True
            )
        ]
    shards = [shard for run, fraction in answer_runs(cfg) for shard in answer_shards(run, fraction)]
    held_prompts = {prompt_of(doc) for _, docs, held in shards for doc, h in zip(docs, held, strict=True) if h}
    answers, held_out, trained, repeated = [], [], set(), 0
    for path, docs, held in shards:
        for doc, h, f in zip(docs, held, stored(path, len(docs)), strict=True):
            prompt = prompt_of(doc)
            if not h and (prompt in held_prompts or prompt in trained):
                repeated += 1
                continue
            trained.add(prompt)
            # The distribution of answer token j conditions on the prompt and answer[:j], so it
            # is learned at the position just before that token.
            example = Example(doc["ids"], doc["prompt_len"] - 1, doc["top_logp"], doc["top_idx"], features=f)
            (held_out if h else answers).append(example)
    if repeated:
        log.info("%d answer(s) to a prompt answered before or held out were left out of training", repeated)
    if not source and not answers:
        raise SpecbenchError(f"no teacher data in {cfg.out}: raise --teacher-tokens or --generate-prompts")
    return source + answers * cfg.generated_repeats, held_out


def epoch_batches(lengths: list[int], batch: int, seed: int) -> list[list[int]]:
    """A seeded shuffle cut into batches of similar length (sorted within windows of 32 batches),
    so little compute goes on padding; the batches themselves come in random order."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    batches = []
    for i in range(0, len(order), batch * 32):
        window = sorted(order[i : i + batch * 32], key=lengths.__getitem__)
        batches += [window[j : j + batch] for j in range(0, len(window), batch)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def agreement(student, examples: list[Example], batch: int) -> float | None:
    """How often the student's top token is the teacher's, over the labelled positions."""
    if not examples:
        return None
    hits = total = 0.0
    student.eval()
    with torch.inference_mode():
        for i in range(0, len(examples), batch):
            b = collate(examples[i : i + batch])
            hits += (labelled_logits(student, b).argmax(-1) == b["top_idx"][b["labelled"]][:, 0]).sum().item()
            total += b["labelled"].sum().item()
    student.train()
    return hits / total


def train_student(cfg: DistillConfig, target: LoadedModel) -> Iterator[TrainingProgress]:
    """Train (or resume training) the student on the stored teacher data."""
    if cfg.tokenizer_vocab:
        raise SpecbenchError("--tokenizer-vocab: the draft trains in distill_own_tokenizer.distill_own_vocabulary")
    examples, held_out = load_examples(cfg)
    student = new_student(cfg, target)

    def batch_loss(rows: list[int]) -> torch.Tensor:
        b = collate([examples[i] for i in rows])
        return kd_loss(labelled_logits(student, b), b["top_logp"][b["labelled"]], b["top_idx"][b["labelled"]])

    held = yield from optimise(
        cfg, student, [len(e.ids) for e in examples], batch_loss, lambda: (agreement(student, held_out, cfg.batch),)
    )
    shortlist = head_tokens(examples, cfg.draft_vocab, target.width)
    save_draft(
        student, target, cfg, held[0] if held else None, shortlist, held_out_coverage=coverage(shortlist, held_out)
    )


def optimise(cfg: DistillConfig, model, lengths: list[int], batch_loss, evaluate, phase: str = "student"):
    """Train ``model`` on ``cfg.epochs`` passes of seeded batches of examples of these ``lengths``
    (AdamW, warmup, cosine decay), resuming from train_state.pt; ``batch_loss(rows)`` is the loss of
    the examples at rows, ``evaluate()`` the held-out agreements (a tuple), saved with the state.
    Yields TrainingProgress; returns the last agreements."""
    per_epoch = len(epoch_batches(lengths, cfg.batch, 0))
    total = math.ceil(per_epoch * cfg.epochs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)),
    )
    state_path = cfg.out / "train_state.pt"
    device_type = next(model.parameters()).device.type
    step, held = 0, None
    if state_path.exists():
        state = torch.load(state_path)
        try:
            model.load_state_dict(state["model"])
        except RuntimeError:  # shapes differ: the options that size the model changed between runs
            raise SpecbenchError(
                f"{state_path} was saved by a run with a model of another shape (--init, --draft-vocab, --tokenizer-vocab "
                "or the size options): run again with that run's options, or give another --out"
            ) from None
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, held = state["step"], state.get("agreement")
        held = (held,) if isinstance(held, float) else held  # a state saved before agreements were tuples
    model.train()
    batches, batches_epoch = [], -1
    while step < total:
        epoch, offset = divmod(step, per_epoch)
        if epoch != batches_epoch:
            batches, batches_epoch = epoch_batches(lengths, cfg.batch, cfg.seed * 1000 + epoch), epoch
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.train_dtype == "bfloat16"):
            loss = batch_loss(batches[offset])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        if step % cfg.eval_every == 0 or step == total:
            held = evaluate()
            model.train()
        if step % cfg.save_every == 0 or step == total:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
            }
            with replacing(state_path) as tmp:
                torch.save({**state, "step": step, "agreement": held}, tmp)
        first, later = (held[0], tuple(held[1:])) if held else (None, ())
        yield TrainingProgress(phase, step, total, loss.item(), first, later)
    return held


def head_tokens(examples: list[Example], limit: int = 0, vocab: int = 0) -> list[int]:
    """The ids that are the teacher's top choice somewhere in the training data, sorted: the
    drafter's vocabulary (a few thousand of the target's tens of thousands of ids). With ``limit``,
    only the ``limit`` most frequent of them (ties to the lower id): the vocabulary projection is
    much of a small drafter's step, and the rarest ids are first choices at few positions. Where the
    data holds fewer than ``limit`` such ids, the lowest of the target's other ids (below ``vocab``)
    fill the rest: a BPE vocabulary numbers its tokens in the order it merged them, the commonest
    first, so they are the likeliest of the ids the data never showed."""
    ids, counts = torch.cat([e.top_idx[:, 0] for e in examples]).unique(return_counts=True)  # ids ascending
    if 0 < limit < len(ids):  # a stable sort keeps the lower id first among equal counts
        ids = ids[torch.sort(-counts, stable=True).indices[:limit]]
    chosen = set(ids.tolist())
    unseen = (i for i in range(vocab) if i not in chosen)
    chosen.update(next(unseen) for _ in range(min(limit, vocab) - len(chosen)))
    return sorted(chosen)


def coverage(ids: list[int], examples: list[Example]) -> float | None:
    """The share of the teacher's top choices at the examples' labelled positions that are among ``ids``
    (on held-out greedy answers: the share of the target's output tokens a drafter of that vocabulary
    can propose at all)."""
    if not examples:
        return None
    top = torch.cat([e.top_idx[:, 0] for e in examples]).long()
    return torch.isin(top, torch.tensor(ids)).float().mean().item()


def save_draft(
    student,
    target: LoadedModel,
    cfg: DistillConfig,
    held_out_agreement: float | None,
    shortlist: list[int] | None,
    tokenizer=None,
    **more,
) -> None:
    """The distilled draft (see save_checkpoint) with ``tokenizer`` (default: the target's), and
    distill.json, its recipe, with ``more`` figures."""
    save_checkpoint(student, tokenizer or target.tokenizer, cfg.out, shortlist)
    meta = recipe(cfg)
    c = student.config  # a draft trained further keeps its own shape, whatever the size options said
    shape = {
        "hidden_size": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
    }
    head = len(shortlist) if shortlist is not None else None
    meta.update(shape, held_out_greedy_agreement=held_out_agreement, head_tokens=head, **more)
    earlier = Path(cfg.init) / "distill.json"
    if earlier.is_file():  # a draft trained further keeps the recipe it started from
        meta["init_recipe"] = json.loads(earlier.read_text())
    (cfg.out / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")


def recipe(cfg: DistillConfig) -> dict:
    """The options a checkpoint was trained with, as distill.json starts."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}


class PhaseSeconds:
    """The wall-clock seconds each phase has taken, summed over every run that worked on it (a resumed
    run adds its own), kept in OUT/phases.json: what a recipe costs, however often it was interrupted."""

    SAVE_EVERY_S = 30.0

    def __init__(self, out: Path):
        self.path = out / "phases.json"
        self.seconds: dict[str, float] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def timed(self, phases: Iterator[TrainingProgress]) -> Iterator[TrainingProgress]:
        began = saved = time.monotonic()
        try:
            for p in phases:
                now = time.monotonic()
                self.seconds[p.phase] = self.seconds.get(p.phase, 0.0) + now - began
                began = now
                if now - saved >= self.SAVE_EVERY_S or p.done == p.total:
                    self.save()
                    saved = now
                yield p
        finally:  # an interrupted run keeps what it spent
            self.save()

    def save(self) -> None:
        with replacing(self.path) as tmp:
            tmp.write_text(json.dumps({k: round(v, 3) for k, v in self.seconds.items()}, indent=2) + "\n")


def distill(cfg: DistillConfig, target: LoadedModel, train=train_student) -> Iterator[TrainingProgress]:
    """The teacher and generate phases, then ``train`` (a draft's student phase, or distill_eagle's, or
    with --tokenizer-vocab distill_own_tokenizer's), each phase's time added to OUT/phases.json."""
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    record_settings(cfg.out, asdict(cfg))
    yield from PhaseSeconds(cfg.out).timed(_phases(cfg, target, train))


def _phases(cfg: DistillConfig, target: LoadedModel, train) -> Iterator[TrainingProgress]:
    if cfg.top_k > target.width:
        # A k beyond the vocabulary asks for every probability, and keeping the whole vocabulary gives
        # exactly that (transformers' top-k sampling clamps k alike); refusing would only make the user
        # look the size up. The recipe records the k used.
        log.info(
            "--top-k %d is more than %s's %d ids: the teacher keeps all of them", cfg.top_k, cfg.target, target.width
        )
        cfg = replace(cfg, top_k=target.width)
    if cfg.draft_vocab > target.width:
        # As for --top-k: a drafter's vocabulary of more ids than the target has is all of them, which
        # head_tokens gives (it fills the shortlist with the ids the data never showed); the recipe records it.
        log.info(
            "--draft-vocab %d is more than %s's %d ids: the drafter keeps all of them",
            cfg.draft_vocab,
            cfg.target,
            target.width,
        )
        cfg = replace(cfg, draft_vocab=target.width)
    if cfg.teacher_tokens and not cfg.tokenizer_vocab:  # a draft of its own tokenizer reads --source as text
        stream = token_stream(target.tokenizer, source_files(cfg.sources), cfg.seed)
        yield from teacher_shards(cfg, target, stream, cfg.teacher_tokens, cfg.out / "teacher")
    if cfg.generate_prompts:
        yield from generated_shards(cfg, target)
    yield from train(cfg, target)
