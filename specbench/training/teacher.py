"""Who writes the target's answers for `specbench distill` (--teacher-engine): the target itself in
torch (transformers' generate, a batch at a time), the same weights served by llama.cpp's
llama-server, or the target's checkpoint in vLLM in this process (continuous batching, on a GPU the
fastest of the three).

Either way an answer is a ``TeacherAnswer``: the tokens the target wrote, through its first stop token,
and its top-k log-probabilities at each of them (the distribution the drafter learns). Another
engine's answers are only worth training on if they come from the target's weights:
``weights_check`` reads a sample of them again with the torch target, teacher-forced, and
``agreement`` says how often the two agree on the likeliest token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specbench.core.environment import cache_dir
from specbench.core.errors import SpecbenchError
from specbench.decoding.sampling import Sampling
from specbench.engines import Served, llamacpp
from specbench.engines import vllm as vllm_engine
from specbench.engines.launch import launched
from specbench.models.load import LoadedModel, model_dir
from specbench.models.names import resolve

log = logging.getLogger("specbench")

ENGINES = ("torch", "llama-cpp", "vllm")
# What counts as the same weights, read against the torch target: its likeliest token the same at
# MIN_AGREEMENT of the positions, and its log-probability of the engine's likeliest token within
# MAX_LOGP_DIFFERENCE on average. The default target's own Q4_1 file in llama.cpp against its torch
# conversion: 96.9% and 0.04 (they differ at near-ties, where the kernels round differently). The
# shipped draft, distilled from that target: 81% and 0.66 on function stubs, so agreement alone
# would let a good enough drafter pass for its target.
MIN_AGREEMENT = 0.9
MAX_LOGP_DIFFERENCE = 0.25
CHECKED_ANSWERS = 16  # answers of the first shard read again by the torch target
REQUEST_TIMEOUT_S = 1800.0  # a whole shard's answers may queue behind one another on 2 cores


@dataclass
class TeacherAnswer:
    tokens: list[int]  # through the first stop token
    top_logp: torch.Tensor  # [len(tokens), k] float16: the target's top-k log-probabilities there
    top_idx: torch.Tensor  # [len(tokens), k] int32: their token ids, likeliest first
    dropped: int = 0  # tokens the engine wrote but gave no probabilities for, cut off the end


# What answers a shard: (prompts' ids, sampled at T=1 or greedy, seed) -> one TeacherAnswer per prompt.
Answerer = Callable[[list[list[int]], bool, int], list[TeacherAnswer]]


def through_stop(tokens: list[int], stop: frozenset[int] | set[int]) -> int:
    """How many of ``tokens`` an answer keeps: through its first stop token, else all."""
    return next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids left-padded with ``pad`` to one length, and the attention mask that hides the pads."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def torch_answers(target: LoadedModel, new_tokens: int, top_k: int) -> Answerer:
    """The torch target answering a batch at once with transformers' generate, its top-k recorded as it goes."""
    tokenizer = target.tokenizer
    # Batches are left-padded explicitly: the attention mask keeps the pads out of every forward
    # (generate derives the positions from it too) and they are cut off below, so any id pads: the
    # tokenizer's pad token, else its EOS, else 0 (Llama's tokenizers have no pad token, and a
    # tokenizer may have no EOS either).
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)

    def answer(prompts: list[list[int]], sampled: bool, seed: int) -> list[TeacherAnswer]:
        ids, mask = left_padded(prompts, pad)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=ids.to(target.model.device),
                attention_mask=mask.to(target.model.device),
                max_new_tokens=new_tokens,
                do_sample=sampled,
                temperature=1.0 if sampled else None,
                top_k=None,
                top_p=None,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
            )
            top = [step[:, : target.width].float().log_softmax(-1).topk(top_k, dim=-1) for step in out.logits]
        top_logp = torch.stack([t.values for t in top], 1).half().cpu()
        top_idx = torch.stack([t.indices for t in top], 1).int().cpu()
        tokens = out.sequences[:, ids.shape[1] :].tolist()
        kept = [through_stop(row, target.stop_ids) for row in tokens]
        return [
            TeacherAnswer(row[:n], top_logp[r, :n].clone(), top_idx[r, :n].clone())
            for r, (row, n) in enumerate(zip(tokens, kept, strict=True))
        ]

    return answer


def completion_body(prompt: list[int], new_tokens: int, top_k: int, sampled: bool, seed: int) -> dict:
    """llama-server's /completion request for one answer with its top-k log-probabilities.

    The sampler chain is made plain (no top-k, top-p or min-p cut; T=1 or greedy), so a sampled
    answer is drawn from the target's own softmax. ``n_probs`` without ``post_sampling_probs`` gives
    the softmax of the raw logits at every position, greedy or not: the distribution torch records."""
    return {
        "prompt": prompt,
        "n_predict": new_tokens,
        "temperature": 1.0 if sampled else 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": seed,
        "n_probs": top_k,
        "cache_prompt": False,
        "return_tokens": True,
    }


def parsed_completion(reply: dict, top_k: int, stop: frozenset[int] | set[int]) -> TeacherAnswer:
    """A TeacherAnswer from llama-server's /completion reply: its ``tokens`` (the stop token included) through
    the first stop token, with the top log-probabilities of ``completion_probabilities``.

    llama-server lists no probabilities for a token that ends inside a multi-byte character (the
    entry comes with the token that completes it), so the answer is kept only up to the first such
    token: beyond it positions and probabilities no longer line up. ``dropped`` counts what is cut."""
    tokens = [int(t) for t in reply.get("tokens") or []]
    positions = reply.get("completion_probabilities") or []
    aligned = 0
    while aligned < min(len(tokens), len(positions)) and int(positions[aligned]["id"]) == tokens[aligned]:
        aligned += 1
    n = through_stop(tokens[:aligned], stop)
    logp, idx = [], []
    for p in positions[:n]:
        tops = sorted(p.get("top_logprobs") or [], key=lambda t: -t["logprob"])[:top_k]
        if len(tops) < top_k:
            raise SpecbenchError(
                f"llama-server gave {len(tops)} of the {top_k} top log-probabilities asked for: lower --top-k"
            )
        logp.append([t["logprob"] for t in tops])
        idx.append([int(t["id"]) for t in tops])
    shape = (n, top_k)
    return TeacherAnswer(
        tokens[:n],
        torch.tensor(logp, dtype=torch.float32).reshape(shape).half(),
        torch.tensor(idx, dtype=torch.int32).reshape(shape),
        dropped=through_stop(tokens, stop) - n,
    )


@contextmanager
def llama_cpp_answers(
    target: LoadedModel,
    gguf: Path,
    server: Path,
    slots: int,
    context: int,
    new_tokens: int,
    top_k: int,
    log_dir: Path,
) -> Iterator[Answerer]:
    """llama-server serving ``gguf`` with ``slots`` answers at once, ``context`` tokens each, for the
    length of the block; its log is ``log_dir``/teacher-llama-cpp.log."""
    command = llamacpp.command(server, gguf, slots, context)
    with launched("teacher-llama-cpp", command, log_dir, who="--teacher-engine llama-cpp") as url:
        root = url.removesuffix("/v1")

        def answer(prompts: list[list[int]], sampled: bool, seed: int) -> list[TeacherAnswer]:
            replies = asyncio.run(_completions(root, prompts, new_tokens, top_k, sampled, seed, slots))
            return [parsed_completion(r, top_k, target.stop_ids) for r in replies]

        yield answer


async def _completions(
    root: str, prompts: list[list[int]], new_tokens: int, top_k: int, sampled: bool, seed: int, slots: int
) -> list[dict]:
    import aiohttp

    gate = asyncio.Semaphore(slots)
    # A connection per request: llama-server (cpp-httplib) closes kept-alive ones under the client
    # (engines/server.py).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int, prompt: list[int]) -> dict:
            body = completion_body(prompt, new_tokens, top_k, sampled, seed + i)
            async with gate:
                try:
                    async with session.post(root + "/completion", json=body) as response:
                        if response.status >= 400:
                            said = (await response.text())[:200].replace("\n", " ")
                            raise SpecbenchError(
                                f"--teacher-engine llama-cpp: llama-server answered HTTP {response.status} ({said})"
                            )
                        return await response.json()
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    raise SpecbenchError(
                        f"--teacher-engine llama-cpp: llama-server did not answer ({type(e).__name__}: {e})"
                    ) from None

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def check_installed(engine: str) -> None:
    """Refuse --teacher-engine vllm where vLLM is not installed (llama-server is looked for when it starts)."""
    if engine == "vllm" and not vllm_engine.available():
        raise SpecbenchError(
            "--teacher-engine vllm needs vLLM, which lives in an environment of its own: run `make install-vllm` "
            "and then .venv-vllm/bin/specbench distill, or use --teacher-engine torch"
        )


@contextmanager
def vllm_answers(target: LoadedModel, slots: int, context: int, new_tokens: int, top_k: int, seed: int):
    """vLLM in this process serving the target's checkpoint, ``slots`` answers at once, ``context``
    tokens each, for the length of the block. Its log-probabilities are the raw logits' softmax
    (vLLM's default logprobs mode), the distribution torch records. On a CPU, vLLM samples every
    request from the engine's one generator, seeded by ``seed`` (engines/vllm.py), so a sampled
    shard is reproducible only when the whole run is. DistillConfig.validate has checked that vLLM is
    installed (check_installed)."""
    spec = vllm_engine.EngineSpec(
        model=model_dir(target),
        dtype=str(target.model.dtype).removeprefix("torch."),
        seed=seed,
        max_model_len=context,
        max_num_seqs=slots,
        extra={"max_logprobs": top_k},  # vLLM refuses more than 20 unless told
    )
    with vllm_engine.Engine(spec) as engine:

        def answer(prompts: list[list[int]], sampled: bool, seed: int) -> list[TeacherAnswer]:
            sampling = Sampling(
                temperature=1.0 if sampled else 0.0,
                max_new_tokens=new_tokens,
                seed=seed,
                stop_ids=tuple(target.stop_ids),
                logprobs=top_k,
            )
            served = sorted(engine.run(prompts, slots, sampling), key=lambda s: s.index)
            return [served_answer(s, top_k, target.stop_ids) for s in served]

        yield answer


def served_answer(served: Served, top_k: int, stop: frozenset[int] | set[int]) -> TeacherAnswer:
    """A TeacherAnswer from an engine's Served with per-position top ids and log-probabilities (likeliest
    first): its tokens through the first stop token, the top ``top_k`` of each position (vLLM adds
    the sampled token's where it is not among them: it ranks last and is cut)."""
    n = through_stop(served.tokens, stop)
    logp, idx = (served.logprobs or [])[:n], (served.top_ids or [])[:n]
    if len(logp) < n or any(len(row) < top_k for row in logp):
        raise SpecbenchError(f"the engine gave fewer than the {top_k} top log-probabilities asked for: lower --top-k")
    return TeacherAnswer(
        served.tokens[:n],
        torch.tensor([row[:top_k] for row in logp], dtype=torch.float32).reshape(n, top_k).half(),
        torch.tensor([row[:top_k] for row in idx], dtype=torch.int32).reshape(n, top_k),
    )


def agreement(logp: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor) -> tuple[int, float]:
    """How many positions another engine's likeliest token (``top_idx[:, 0]``) is also the argmax of the
    torch target's log-probabilities ``logp`` [n, vocab], and the summed |difference| of the two log-
    probabilities of that token."""
    ids = top_idx[:, 0].long()
    agree = int((logp.argmax(-1) == ids).sum())
    gap = float((logp.gather(-1, ids[:, None])[:, 0] - top_logp[:, 0].float()).abs().sum())
    return agree, gap


def weights_check(target: LoadedModel, prompts: list[list[int]], answers: list[TeacherAnswer]) -> dict:
    """The torch target reads up to CHECKED_ANSWERS of another engine's answers after their prompts;
    how far its next-token distributions agree with the ones the engine recorded."""
    agree, gap, positions = 0, 0.0, 0
    with torch.inference_mode():
        for prompt, answer in list(zip(prompts, answers, strict=True))[:CHECKED_ANSWERS]:
            if not answer.tokens:
                continue
            ids = torch.tensor([prompt + answer.tokens], device=target.model.device)
            logits = target.model(input_ids=ids).logits[0, len(prompt) - 1 : -1, : target.width]
            a, g = agreement(logits.float().log_softmax(-1).cpu(), answer.top_idx, answer.top_logp)
            agree, gap, positions = agree + a, gap + g, positions + len(answer.tokens)
    return {
        "positions": positions,
        "top1_agreement": agree / positions if positions else None,
        "mean_abs_logp_difference": gap / positions if positions else None,
    }


def gguf_of(given: str | None, target_name: str, target: LoadedModel, server: Path) -> Path:
    """The GGUF llama.cpp answers from: ``given`` (--teacher-gguf), else the target's own .gguf, else
    its checkpoint converted to f32 (once, cached) by llama.cpp's converter."""
    if given:
        return Path(given).expanduser()
    source = resolve(target_name)
    if source.kind == "gguf":
        return Path(source.location)
    return llamacpp.gguf_of(Path(model_dir(target)), "f32", server, cache_dir() / "gguf")


def same_weights(engine: str, target_name: str, target: LoadedModel, prompts: list[list[int]], answers, record: Path):
    """Refuse ``engine``'s answers unless the torch target, reading a sample of them, agrees on the
    likeliest token at MIN_AGREEMENT of the positions and on its log-probability within
    MAX_LOGP_DIFFERENCE; what it found goes to teacher.json in ``record``."""
    found = {"engine": engine, **weights_check(target, prompts, answers)}
    (record / "teacher.json").write_text(json.dumps(found, indent=2) + "\n")
    agree = found["top1_agreement"]
    if agree is None:
        return
    said = (
        f"the torch target agrees with --teacher-engine {engine}'s likeliest token at {agree:.1%} of "
        f"{found['positions']} answer positions (mean |log p difference| {found['mean_abs_logp_difference']:.3f})"
    )
    if agree < MIN_AGREEMENT or found["mean_abs_logp_difference"] > MAX_LOGP_DIFFERENCE:
        fix = "give the target's own GGUF (--teacher-gguf) or use" if engine == "llama-cpp" else "use"
        raise SpecbenchError(
            f"{said}: its answers do not come from {target_name}'s weights; {fix} --teacher-engine torch"
        )
    log.info("%s: the same weights", said)
