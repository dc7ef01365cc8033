"""Distil a small draft model from a target that has none.

Two resumable phases, both seeded:
1. teacher: the target reads Python source that is already on the machine (the standard
   library; never an evaluation set) and its top-k next-token distribution is stored in shards;
2. student: a small Llama sharing the target's tokenizer learns those distributions (a KL loss
   against the renormalised top-k), starting from a PCA projection of the target's embeddings.

The result is a plain transformers checkpoint in half precision that ``--draft DIR`` loads.
"""

from __future__ import annotations

import ast
import json
import math
import random
import sysconfig
import textwrap
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import SpecbenchError
from .models import LoadedModel, read_config

SHARD_SEQUENCES = 64


@dataclass
class DistillConfig:
    out: Path
    target: str = "smollm2-135m"
    hidden_size: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 768
    init: str = "pca"  # "pca": project the target's embeddings; "random": transformers' init
    seq_len: int = 256
    teacher_tokens: int = 300_000
    teacher_batch: int = 8
    top_k: int = 32
    epochs: float = 3.0
    batch: int = 8
    lr: float = 2e-3
    warmup_steps: int = 30
    save_every: int = 50
    seed: int = 0
    sources: list[str] = field(default_factory=lambda: [sysconfig.get_paths()["stdlib"]])
    # Conversations the target writes itself: function stubs from the sources, sent through the
    # same instruction and chat template as the evaluation prompts (never the evaluation items).
    generate_prompts: int = 128
    generate_new_tokens: int = 160
    generate_batch: int = 16
    generated_repeats: int = 4  # in-distribution text, so it counts this many times per epoch

    def validate(self) -> None:
        if self.init not in ("pca", "random"):
            raise SpecbenchError(f"--init {self.init}: use pca or random")
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise SpecbenchError("--hidden-size must divide by --heads, and --heads by --kv-heads")
        if self.hidden_size <= 0 or self.layers <= 0 or self.teacher_tokens < self.seq_len or self.epochs <= 0:
            raise SpecbenchError("sizes, --teacher-tokens (>= --seq-len) and --epochs must be positive")


@dataclass
class Progress:
    phase: str  # "teacher:<shard dir>", "generate" or "student"
    done: int
    total: int
    loss: float | None = None


def source_files(roots: list[str]) -> list[Path]:
    """Python files under ``roots``, minus installed third-party packages and test suites."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = []
    for root in roots:
        root_path = Path(root)
        if not root_path.exists():
            raise SpecbenchError(f"training source {root} does not exist: pass directories of text or code with --source")
        candidates = [root_path] if root_path.is_file() else root_path.rglob("*.py")
        files += [p for p in candidates if not skip & set(p.relative_to(root_path).parts)]
    return sorted(files)


def token_stream(tokenizer, files: list[Path], seed: int) -> Iterator[int]:
    """Token ids of the files in a seeded random order, each file closed by EOS."""
    order = list(files)
    random.Random(seed).shuffle(order)
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from tokenizer(text).input_ids
        yield tokenizer.eos_token_id


def function_stubs(files: list[Path], seed: int, limit: int) -> list[str]:
    """HumanEval-shaped stubs (a def line and its docstring) from functions in the sources."""
    stubs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                stub = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
                if 80 <= len(stub) <= 700:
                    stubs.append(stub)
    random.Random(seed).shuffle(stubs)
    return stubs[:limit]


def generated_documents(cfg: DistillConfig, target: LoadedModel) -> Generator[Progress, None, list[list[int]]]:
    """Token ids of conversations the target completes itself (half greedy, half sampled at T=1),
    saved after every batch so an interrupted run resumes where it stopped. Yields progress and
    returns the documents."""
    path = cfg.out / "generated.pt"
    docs: list[list[int]] = torch.load(path) if path.exists() else []
    stubs = function_stubs(source_files(cfg.sources), cfg.seed, cfg.generate_prompts)
    instruction = read_config("datasets.toml")["humaneval"]["instruction"]
    tokenizer = target.tokenizer
    if tokenizer.pad_token is None:  # batched generation pads; EOS padding is masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    pad = tokenizer.pad_token_id
    while len(docs) < len(stubs):
        batch = stubs[len(docs) : len(docs) + cfg.generate_batch]
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": instruction.format(prompt=stub)}], add_generation_prompt=True, tokenize=False)
            if tokenizer.chat_template
            else stub
            for stub in batch
        ]
        tokenizer.padding_side = "left"
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=tokenizer.chat_template is None)
        sampled = (len(docs) // cfg.generate_batch) % 2 == 1
        torch.manual_seed(cfg.seed + len(docs))
        with torch.inference_mode():
            out = target.model.generate(
                **enc.to(target.model.device), max_new_tokens=cfg.generate_new_tokens, do_sample=sampled,
                temperature=1.0 if sampled else None, top_k=None, top_p=None, pad_token_id=pad,
            )
        for row, mask in zip(out.tolist(), enc.attention_mask.tolist()):
            prompt_pad = mask.count(0)
            tokens = row[prompt_pad:]
            while tokens and tokens[-1] == pad and len(tokens) > len(mask) - prompt_pad:
                tokens.pop()  # right padding after an early stop
            docs.append(tokens)
        torch.save(docs, path)
        yield Progress("generate", len(docs), len(stubs))
    return docs


def teacher_shards(
    cfg: DistillConfig, target: LoadedModel, stream: Iterator[int], n_tokens: int, shard_dir: Path
) -> Iterator[Progress]:
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
            raise SpecbenchError(f"the sources hold fewer than {n_tokens} tokens: lower --teacher-tokens or add --source")
        if path.exists():
            yield Progress(phase, shard * SHARD_SEQUENCES + count, n_seqs)
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
                yield Progress(phase, shard * SHARD_SEQUENCES + start + len(batch), n_seqs)
        tmp = path.with_suffix(".tmp")
        torch.save({"ids": ids.int(), "top_logp": torch.cat(top_logp), "top_idx": torch.cat(top_idx)}, tmp)
        tmp.replace(path)


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
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    student = LlamaForCausalLM(draft_config(cfg, target))
    if cfg.init == "pca":
        embeddings = target.model.get_input_embeddings().weight.detach()[: target.width]
        with torch.no_grad():
            student.get_input_embeddings().weight.copy_(pca_embeddings(embeddings, cfg.hidden_size))
    return student


def kd_loss(student_logits: torch.Tensor, top_logp: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's renormalised top-k distribution."""
    teacher = top_logp.float().softmax(-1)
    student_logp = student_logits.float().log_softmax(-1).gather(-1, top_idx.long())
    return -(teacher * student_logp).sum(-1).mean()


def load_shards(cfg: DistillConfig) -> dict[str, torch.Tensor]:
    shards = [torch.load(p) for p in sorted((cfg.out / "teacher").glob("*.pt"))]
    shards += [torch.load(p) for p in sorted((cfg.out / "teacher-generated").glob("*.pt"))] * cfg.generated_repeats
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


def train_student(cfg: DistillConfig, target: LoadedModel) -> Iterator[Progress]:
    """Train (or resume training) the student on the stored teacher shards."""
    data = load_shards(cfg)
    n = data["ids"].shape[0]
    steps_per_epoch = n // cfg.batch
    total = int(steps_per_epoch * cfg.epochs)
    student = new_student(cfg, target)
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)),
    )
    state_path = cfg.out / "train_state.pt"
    step = 0
    if state_path.exists():
        state = torch.load(state_path)
        student.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = state["step"]
    student.train()
    while step < total:
        epoch, offset = divmod(step, steps_per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        rows = order[offset * cfg.batch : (offset + 1) * cfg.batch]
        logits = student(input_ids=data["ids"][rows].long()).logits
        loss = kd_loss(logits, data["top_logp"][rows], data["top_idx"][rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        if step % cfg.save_every == 0 or step == total:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": student.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step}, tmp)
            tmp.replace(state_path)
        yield Progress("student", step, total, loss.item())
    save_draft(student, target, cfg)


def save_draft(student, target: LoadedModel, cfg: DistillConfig) -> None:
    """A plain half-precision checkpoint plus the target's tokenizer, loadable with --draft DIR."""
    student.eval()
    student.half().save_pretrained(cfg.out)
    target.tokenizer.save_pretrained(cfg.out)
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    (cfg.out / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")


def distill(cfg: DistillConfig, target: LoadedModel) -> Iterator[Progress]:
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    stream = token_stream(target.tokenizer, source_files(cfg.sources), cfg.seed)
    yield from teacher_shards(cfg, target, stream, cfg.teacher_tokens, cfg.out / "teacher")
    if cfg.generate_prompts:
        docs = yield from generated_documents(cfg, target)
        flat = [t for doc in docs for t in doc + [target.tokenizer.eos_token_id]]
        yield from teacher_shards(cfg, target, iter(flat), len(flat), cfg.out / "teacher-generated")
    yield from train_student(cfg, target)
