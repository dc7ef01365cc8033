"""The loaded pair and the prompts' token ids: what every method decodes with, and on.

The one place a run's models are loaded and its prompts encoded; methods, cost measurement and the
benchmark take the Pair from here. Loading runs one way: models.load_models resolves and loads
everything model-side in one call, then the EAGLE head and each model's forward are built on it;
encoding reads only the Pair.
"""

from __future__ import annotations

import gc
import hashlib
import logging
from dataclasses import dataclass, replace

import torch

from specbench.core.errors import SpecbenchError
from specbench.decoding.sampling import Sampling
from specbench.decoding.timing import PhaseClock, TimedLM
from specbench.models.eagle_head import EagleHead, load_head
from specbench.models.fast import sliding_window, unsupported
from specbench.models.lm import HFCausalLM
from specbench.models.load import LoadedModel, Wanted, load_models
from specbench.models.static import StaticLM
from specbench.models.static_head import StaticHead
from specbench.models.vocab import Bridge, bridge_of
from specbench.workloads.prompts import Prompt, Turn, some, turns_of

log = logging.getLogger("specbench")


@dataclass
class Pair:
    """The loaded target, and the draft when a method needs one."""

    target: LoadedModel
    target_lm: HFCausalLM | None  # None when only another engine (vLLM) decodes: no weights here
    draft: LoadedModel | None
    draft_lm: HFCausalLM | None
    device: torch.device
    dtype: torch.dtype
    width: int  # the logit width target and draft share
    prompt_tokenizer: object | None  # what encodes the prompts (models.Loaded.prompt_tokenizer)
    clock: PhaseClock | None = None  # set on a timed pair: what methods lap their own timed parts on
    head: EagleHead | StaticHead | None = None  # the --speculator head, when an EAGLE method decodes here
    bridge: Bridge | None = None  # the two vocabularies, when the draft's tokenizer is not the target's

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.target.stop_ids

    def reserve(self, tokens: int, widest: int = 1, sampling: Sampling | None = None) -> None:
        """Room for sequences of ``tokens`` in the caches of the models on the static path, allocated
        now, before anything is compiled against them or timed; on CUDA their graphs for forwards as
        wide as ``widest`` (the run's widest verification) and more captured now too, and the chains
        that the draft or the head draft under ``sampling`` (reserve_chains)."""
        if isinstance(self.target_lm, StaticLM):  # an EAGLE head's target also records the head's features
            self.target_lm.reserve(tokens, widest, None if self.head is None else self.head.config.taps)
        for lm in (self.draft_lm, self.head):
            if isinstance(lm, (StaticLM, StaticHead)):
                lm.reserve(tokens, widest)
                if sampling is not None:
                    lm.reserve_chains(sampling)

    def builds_at_reserve(self) -> str | None:
        """What reserve will build before anything is timed, in a few words ("compiling the static
        path's forwards", and on CUDA "capturing CUDA graphs"); None when it builds nothing."""
        static = [lm for lm in (self.target_lm, self.draft_lm, self.head) if isinstance(lm, (StaticLM, StaticHead))]
        if not any(lm.compiling for lm in static):
            return None
        graphs = any(lm.graphed for lm in static)
        return "compiling the static path's forwards" + (" and capturing CUDA graphs" if graphs else "")

    def without_weights(self) -> Pair:
        """This pair with its models' memory let go, before another engine loads its own copy onto the
        same device: the modules moved to the meta device (shapes and configs stay), and what the loop's
        models hold beside them (specbench's forward over the weights, caches, CUDA graphs) dropped, as
        is the EAGLE head. Whatever else still refers to the loop's models (its loops, the methods'
        views) must be let go too; then return_cached_memory."""
        for lm in (self.target_lm, self.draft_lm):
            if lm is not None:
                lm.release()
        for model in (self.target, self.draft):
            if model is not None:
                model.model.to("meta")
        return replace(self, target_lm=None, draft_lm=None, head=None)

    def return_cached_memory(self) -> None:
        """Give the device the memory that torch's allocator caches for tensors now gone (collected
        first: it hands back only blocks that no tensor holds), so that another process can use it."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def timed(self, clock: PhaseClock) -> Pair:
        """This pair with every forward of its models lapped on ``clock``."""
        draft_lm = TimedLM(self.draft_lm, clock, "draft") if self.draft_lm else None
        return replace(self, target_lm=TimedLM(self.target_lm, clock, "verify"), draft_lm=draft_lm, clock=clock)


def default_compile(device: torch.device) -> bool:
    """Whether a run that leaves --compile out gets specbench's own forward on ``device``. Not on CUDA:
    at batch 1 a forward there is bound by kernel launches, and inductor's fused elementwise work,
    called through its wrappers 4 times a layer, made llama-7b's step slower than transformers' eager
    one on both GPUs measured (docs/results.md#on-a-gpu); CUDA's default is the static path
    (default_graphs). On a CPU the packed weights pay."""
    return device.type != "cuda"


def default_graphs(device: torch.device, compile: bool | None) -> bool:
    """Whether a run that leaves --graphs out gets the static path (models/static.py) on ``device``: on
    CUDA, unless --no-compile asked for transformers' eager forward. Not on a CPU, where the packed
    forward measured faster on the default pair (docs/results.md)."""
    return device.type == "cuda" and compile is not False


def load_pair(wanted: Wanted, compile: bool | None = None, threads: int = 0, graphs: bool | None = None) -> Pair:
    """The models ``wanted`` says, loaded once (models.load_models), wrapped for specbench's loop: the
    static path where ``graphs`` asks for it and covers the model, else its own forward where
    ``compile`` allows (lm.HFCausalLM.loaded); and the EAGLE head of ``wanted.speculator``. None for
    either: the device's default (default_graphs, default_compile). ``threads``: torch's CPU threads
    (0 leaves torch's choice)."""
    if threads:
        torch.set_num_threads(threads)
    loaded = load_models(wanted)
    device = torch.device(loaded.device)
    graphs = default_graphs(device, compile) if graphs is None else graphs
    compile = default_compile(device) if compile is None else compile
    target, draft, width = loaded.target, loaded.draft, loaded.width
    bridge = None
    if loaded.vocabularies_differ:  # the draft keeps its own logits; drafters/vocab.py maps them
        bridge = bridge_of(target.tokenizer, draft.tokenizer, target.width, draft.width)
        log.info("%s and %s have tokenizers of their own: %d tokens in both", target.name, draft.name, bridge.shared)
    pair = Pair(target, None, draft, None, loaded.device, loaded.dtype, width, loaded.prompt_tokenizer, bridge=bridge)
    if not wanted.weights:  # only vLLM decodes: it loads the weights, this process needs their shapes
        return pair
    # Packed products are oneDNN's, which the static path's compiler cannot take: the head packs without it.
    head = load_head(loaded.speculator, target.model, compile and not graphs) if loaded.speculator else None
    target_lm = loop_lm(target.model, width, None, compile, graphs, target.name)
    draft_width = draft.width if bridge else width
    draft_lm = loop_lm(draft.model, draft_width, draft.head_tokens, compile, graphs, draft.name) if draft else None
    if head is not None and isinstance(target_lm, StaticLM):  # the head's steps on the static path too
        head = StaticHead(head, target_lm.kv.capacity)
    return replace(pair, target_lm=target_lm, draft_lm=draft_lm, head=head)


def loop_lm(model, width: int, head_tokens, compile: bool, graphs: bool, name: str) -> HFCausalLM:
    """``model`` (called ``name`` in the log) as specbench's loop runs it: on the static path where
    ``graphs`` asks for it and the path covers the model, else as lm.HFCausalLM.loaded chooses."""
    if graphs:
        reason = unsupported(model)
        if reason is None:
            return StaticLM.of(model, width, head_tokens)
        log.info("%s runs without the static path: %s", name, reason)
    return HFCausalLM.loaded(model, width, head_tokens, compile, name)


@dataclass
class Conversations:
    """The run's prompts as the benchmark decodes them: every turn of every conversation (a row
    each; ``turns[i]`` is prompt_index i), the first turns' token ids, and the token ids of a later
    turn, rendered after the earlier answers of whichever method decodes it."""

    turns: list[Turn]
    first: list[torch.Tensor]  # each conversation's first turn (random ids with --random-weights)
    tokenizer: object | None
    chat: bool  # rendered with the target's chat template, or as plain text
    room: int | None  # the most prompt tokens that leave room for --max-new-tokens and a full draft
    longest: int  # a bound on the prompt tokens of any turn, for an engine's context length

    def ids(self, turn: Turn, answers: list[str]) -> torch.Tensor:
        """Token ids of ``turn`` after ``answers``, the decoding method's own to the turns before it."""
        if turn.turn == 1:
            return self.first[turn.conversation]
        ids = encode_turn(self.tokenizer, turn.prompt, answers, self.chat)
        if self.room is not None and len(ids) > self.room:
            raise SpecbenchError(
                f"turn {turn.turn} of prompt {turn.prompt.id} is {len(ids)} tokens after the answers before it, over the "
                f"{self.room} the context window leaves: lower --max-new-tokens or --max-turns"
            )
        return ids.to(self.first[turn.conversation].device)

    def user_ids(self) -> list[list[int]]:
        """The token ids of what the run's users write: each first turn as it is decoded, and each
        later turn's own message (its rendering waits for the answers before it)."""
        later = [t.prompt.turns[t.turn - 1] for t in self.turns if t.turn > 1]
        return [ids.tolist() for ids in self.first] + [
            self.tokenizer(text, add_special_tokens=False).input_ids for text in later
        ]

    def messages(self, turn: Turn, answers: list[str]) -> list[dict]:
        """``turn`` after ``answers`` as chat messages, for a server that renders its own template."""
        return chat_messages(turn.prompt, answers)

    def answer(self, tokens: list[int]) -> str:
        """A decoded answer as the next turn's conversation holds it (its text without special tokens)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    @property
    def hash(self) -> str:
        """A short hash of what the prompts encode to: two runs are comparable only when it is equal.
        (The first turns' ids, then each later user turn's, encoded alone.)"""
        later = [
            self.tokenizer(text, return_tensors="pt").input_ids[0]
            for turn in self.turns
            if turn.turn > 1
            for text in [turn.prompt.turns[turn.turn - 1]]
        ]
        return prompts_hash(self.first + later)


PLAIN_USER, PLAIN_ASSISTANT = "User:", "Assistant:"  # the rendering without a chat template


def chat_messages(prompt: Prompt, answers: list[str]) -> list[dict]:
    """Turn len(answers) + 1 of ``prompt`` after ``answers`` as chat messages."""
    messages = []
    for user, answer in zip(prompt.turns, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": prompt.turns[len(answers)]}]


def encode_turn(tokenizer, prompt: Prompt, answers: list[str], chat: bool) -> torch.Tensor:
    """Token ids of turn len(answers) + 1 of ``prompt`` after ``answers``: through the chat template,
    or without one the dataset's raw first prompt where it has one, else the conversation as plain
    text ("User: ...", blank line, "Assistant: ...", ending with "Assistant:")."""
    n = len(answers)
    if chat:
        messages = chat_messages(prompt, answers)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if n == 0 and prompt.text is not None:
        return tokenizer(prompt.text, return_tensors="pt").input_ids[0]
    exchanges = [
        f"{PLAIN_USER} {user}\n\n{PLAIN_ASSISTANT} {answer}\n\n"
        for user, answer in zip(prompt.turns, answers, strict=False)
    ]
    text = "".join(exchanges) + f"{PLAIN_USER} {prompt.turns[n]}\n\n{PLAIN_ASSISTANT}"
    return tokenizer(text, return_tensors="pt").input_ids[0]


@dataclass(frozen=True)
class Rendering:
    """How a run's prompts become token ids, and how much room their answers need."""

    max_new_tokens: int
    widest: int  # the most tokens of one target forward (K + 1, or a tree's nodes + 1)
    chat: str = "auto"  # --chat: on, off, or auto (the target's template when it has one)
    context_tokens: int = 0  # a long dataset's prompt length: code to continue as it is (0: not one)
    random_weights: bool = False  # random ids, as many as each prompt encodes to (or prompt_tokens)
    prompt_tokens: int = 0
    seed: int = 0  # of the random ids
    new_tokens_flag: str = "--max-new-tokens"  # the option that set max_new_tokens, for the error that names it


def encode_prompts(pair: Pair, prompts: list[Prompt], how: Rendering) -> Conversations:
    """The run's conversations: each first turn encoded, and the turns that fit the context window.

    A rendered prompt whose first turn leaves no room for --max-new-tokens and a full draft is left out
    (a raw one is cut from the left), and
    a conversation ends before a turn that could outgrow the window (its user turns plus
    --max-new-tokens for each answer before it), each counted in one line; a run left with nothing
    is an error. With random weights the ids are random, as many per prompt as its first turn
    encodes to (or --prompt-tokens), and only first turns are decoded (later ones would continue
    random text).
    """
    models = [pair.target] + ([pair.draft] if pair.draft else [])
    windows = [m.context_window for m in models if m.context_window]
    room = min(windows) - how.max_new_tokens - how.widest if windows else None
    if room is not None and room < 1:
        raise SpecbenchError(
            f"{how.new_tokens_flag} {how.max_new_tokens} plus K does not fit the context window of {min(windows)} "
            f"tokens: lower {how.new_tokens_flag}"
        )
    if how.context_tokens and room is not None and how.context_tokens > room:
        raise SpecbenchError(
            f"--context-tokens {how.context_tokens} with --max-new-tokens {how.max_new_tokens} and K does not fit the "
            f"context window of the models ({room} tokens of prompt fit): lower --context-tokens"
        )
    if how.prompt_tokens and room is not None and how.prompt_tokens > room:  # it was cut to the room, unsaid
        raise SpecbenchError(
            f"--prompt-tokens {how.prompt_tokens} with {how.new_tokens_flag} {how.max_new_tokens} and K does not "
            f"fit the context window of the models ({room} tokens of prompt fit): lower --prompt-tokens"
        )
    if how.random_weights and how.prompt_tokens:  # random prompts of one length: no tokenizer needed
        length = how.prompt_tokens
        tokenizer, chat, first = None, False, [torch.zeros(length, dtype=torch.long)] * len(prompts)
    else:
        tokenizer = pair.prompt_tokenizer
        if tokenizer is None:  # random weights with no tokenizer at hand, or a checkpoint saved without one
            fix = "pass --prompt-tokens N" if how.random_weights else "save its tokenizer beside the weights"
            raise SpecbenchError(f"no tokenizer to encode the prompts for {pair.target.name}: {fix}")
        chat = uses_chat(tokenizer, how.chat, how.context_tokens > 0, pair.target.name)
        first = [_first_ids(tokenizer, prompt, how.context_tokens, chat, room) for prompt in prompts]
    fits = [room is None or len(ids) <= room for ids in first]
    if not any(fits):
        raise SpecbenchError(
            f"every prompt is longer than the {room} tokens the context window leaves beside --max-new-tokens "
            f"{how.max_new_tokens} and K: lower --max-new-tokens"
        )
    if not all(fits):
        too_long = [p.id for p, fit in zip(prompts, fits, strict=True) if not fit]
        log.warning(
            "%d prompt(s) longer than the %d tokens the context window leaves are left out: %s",
            len(too_long),
            room,
            some(too_long),
        )
    prompts = [p for p, fit in zip(prompts, fits, strict=True) if fit]
    first = [ids for ids, fit in zip(first, fits, strict=True) if fit]
    if how.random_weights:
        prompts = [replace(p, turns=p.turns[:1]) for p in prompts]
        generator = torch.Generator().manual_seed(how.seed)
        first = [torch.randint(pair.width, (len(ids),), generator=generator) for ids in first]
    longest = max(map(len, first))
    capped = 0
    for i, prompt in enumerate(prompts):
        for n in range(2, len(prompt.turns) + 1):
            # Each earlier answer adds at most --max-new-tokens (its text re-encodes to about as many).
            bound = len(encode_turn(tokenizer, prompt, [""] * (n - 1), chat)) + (n - 1) * how.max_new_tokens
            if room is not None and bound > room:
                prompts[i] = replace(prompt, turns=prompt.turns[: n - 1])
                capped += 1
                break
            longest = max(longest, bound)
    if capped:
        log.warning(
            "%d conversation(s) end early: a later turn could outgrow the context window (lower --max-new-tokens "
            "to keep it)",
            capped,
        )
    check_sliding_windows(pair, longest + how.max_new_tokens + how.widest, how.new_tokens_flag)
    return Conversations(
        turns_of(prompts),
        [ids.to(pair.device) for ids in first],
        tokenizer,
        chat,
        room,
        longest,
    )


def check_sliding_windows(pair: Pair, tokens: int, new_tokens_flag: str) -> None:
    """Refuse a run whose sequences, up to ``tokens`` long, outgrow the sliding window of a model that
    specbench's loop decodes (none where another engine holds the weights). transformers' sliding
    cache drops what falls out of its window, so a rejected draft can no longer be taken back from it
    (its crop raises): the loop's every speculative round, and the forward costs, need that."""
    for model, lm in ((pair.target, pair.target_lm), (pair.draft, pair.draft_lm)):
        window = sliding_window(model.model.config) if model is not None and lm is not None else None
        if window is not None and tokens > window:
            raise SpecbenchError(
                f"{model.name} attends over a sliding window of {window} tokens and this run's sequences reach "
                f"{tokens} (the longest prompt, {new_tokens_flag} and K + 1): specbench's loop takes rejected "
                f"drafts back from its cache, which transformers' sliding cache cannot do past its window; keep "
                f"them within {window} tokens (--max-new-tokens, --context-tokens)"
            )


def uses_chat(tokenizer, chat: str, long: bool, target: str) -> bool:
    """Whether prompts go through the target's chat template: --chat ``chat`` (on requires one); auto
    uses it when there is one, but not for a ``long`` dataset's code, continued as it is."""
    used = chat == "on" or (chat == "auto" and tokenizer.chat_template is not None and not long)
    if used and tokenizer.chat_template is None:
        raise SpecbenchError(f"--chat on, but {target}'s tokenizer has no chat template: use --chat off")
    return used


def _first_ids(tokenizer, prompt: Prompt, context_tokens: int, chat: bool, room: int | None) -> torch.Tensor:
    """A prompt's first turn. A raw prompt (text to continue) is cut from the left to what fits, as
    its continuation depends on its end, and a long dataset's to --context-tokens; a rendered
    conversation is kept whole (cutting it would cut its template)."""
    ids = encode_turn(tokenizer, prompt, [], chat)
    if not chat and prompt.text is not None and room is not None:
        ids = ids[-room:]
    if context_tokens:
        ids = ids[-context_tokens:]
    if len(ids) == 0:
        raise SpecbenchError(f"prompt {prompt.id} encodes to no tokens: remove it from the dataset")
    return ids


def prompts_hash(prompt_ids: list[torch.Tensor]) -> str:
    """A short hash of the encoded prompts: two runs are comparable only when it is equal."""
    digest = hashlib.sha256()
    for ids in prompt_ids:
        digest.update(ids.to(torch.int64).cpu().numpy().tobytes() + b"|")
    return digest.hexdigest()[:16]
