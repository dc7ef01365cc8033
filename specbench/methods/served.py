"""The methods of the engines that serve requests, apart from specbench's loop: vLLM's (--engine
vllm), a running server (--engine server) and llama.cpp's llama-server (--engine llama-cpp).

Each is a method.Method whose decoding is the engine's: specbench starts the engine (or reaches the
server), sends the requests and reads what the engine says of its speculation.
"""

from __future__ import annotations

import importlib.util

from specbench.core.errors import SpecbenchError
from specbench.engines.llamacpp import Speculation
from specbench.methods.base import Method
from specbench.methods.registry import METHODS
from specbench.models.names import speculator_dir


class VllmMethod(Method):
    """A method of vLLM's (--engine vllm): vLLM decodes, specbench starts the engine, drives the
    requests and reads vLLM's counters. ``speculative_config`` is what vLLM is started with."""

    engine, adjusts_logits = "vllm", True

    def speculative_config(self, k: int | None, draft: str | None, speculator: str | None) -> dict | None:
        """vLLM's speculative_config at lookahead ``k``, with the draft model's directory ``draft``
        and the EAGLE head's ``speculator`` (--speculator) for the methods that use them."""
        return None

    def check_served(self, cfg) -> None:
        """Raise SpecbenchError when this method cannot run with ``cfg`` (before any engine starts)."""


class ServedBaseline(VllmMethod):
    name, help, takes_k = "baseline", "vLLM without speculation: every vLLM method's reference (always runs)", False


class ServedDraft(VllmMethod):
    name, help, needs_draft = (
        "draft",
        "vLLM's draft-model speculation with --draft (specbench's: speculative; for a draft with its own tokenizer, "
        "vLLM's token-level intersection, as speculative-intersection)",
        True,
    )
    crosses_vocabularies = None  # either: ServingRun.spec asks for vLLM's heterogeneous vocabularies where they differ

    def speculative_config(self, k, draft, speculator):
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


class ServedNgram(VllmMethod):
    name, help = "ngram", "vLLM's prompt lookup, n-grams of 1 to 3 tokens as specbench's prompt-lookup"

    def c(self, costs):
        return 0.0  # no model drafts

    def speculative_config(self, k, draft, speculator):
        # The n-gram lengths of specbench's prompt lookup (drafters.PromptLookupDrafter), so the two compare.
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class ServedSuffix(VllmMethod):
    name, help = "suffix", "vLLM's suffix decoding (a suffix tree over prompt and earlier outputs; arctic-inference)"

    def c(self, costs):
        return 0.0

    def speculative_config(self, k, draft, speculator):
        return {"method": "suffix", "num_speculative_tokens": k}

    def check_served(self, cfg):
        if importlib.util.find_spec("arctic_inference") is None:
            raise SpecbenchError(
                "--method suffix needs vLLM's suffix-tree package: .venv-vllm/bin/pip install arctic-inference"
            )


class ServedEagle(VllmMethod):
    """EAGLE heads: the head drafts from the target's hidden states; --speculator names it."""

    name, help = "eagle1", "vLLM's EAGLE(-1) drafting with the head in --speculator"
    kind = "eagle"
    needs_speculator = True

    def speculative_config(self, k, draft, speculator):
        return {"method": self.kind, "model": str(speculator_dir(speculator)), "num_speculative_tokens": k}

    def check_served(self, cfg):
        speculator_dir(cfg.speculator)


class ServedEagle3(ServedEagle):
    name, help, kind = "eagle3", "vLLM's EAGLE-3 drafting with the head in --speculator", "eagle3"


# --launch's names for the servers that do not speculate: the baseline, and the draft alone (for c).
SERVER_BASELINE, SERVER_DRAFT = "baseline", "draft"


class Remote(Method):
    """A running server (--engine server): it decodes whatever it was started with; specbench sends it
    the requests. Its name is the --server NAME (the rows' method); its K is what its responses say,
    else --k. The baseline is the --baseline-url server, which does not speculate. A server specbench
    starts (--launch) has a ``command`` and its URL only once started; one whose command takes
    ``{k}`` is started once per --k, each with ``launched_k`` the K its command was given."""

    engine, adjusts_logits = "server", True  # what the server honours is its own affair

    def __init__(self, name: str, url: str, speculates: bool = True, command: str = "", launched_k: int | None = None):
        self.name, self.url, self.takes_k, self.command, self.launched_k = name, url, speculates, command, launched_k
        self.help = f"the server at {url}" if url else f"the server started by {command}"

    @property
    def server_per_k(self) -> bool:
        """Whether the run starts a server of this method for each K (rows and logs then go by K)."""
        return self.launched_k is not None


# vLLM's methods (--engine vllm), apart from specbench's: their baseline is another engine's.
SERVED: dict[str, VllmMethod] = {
    m.name: m for m in (ServedBaseline(), ServedDraft(), ServedNgram(), ServedSuffix(), ServedEagle(), ServedEagle3())
}
SERVED_BASELINE = SERVED["baseline"]


def served_names(names: list[str]) -> list[str]:
    """The vLLM methods a --method list asks for: vLLM's own names, and the counterparts of specbench's."""
    picked = [
        METHODS[name].counterpart if name in METHODS else name for name in names if name in SERVED or name in METHODS
    ]
    return [name for name in dict.fromkeys(picked) if name and name != SERVED_BASELINE.name]


# The engines spoken to over HTTP: any running server, and llama.cpp's servers specbench starts.
HTTP_ENGINES = ("server", "llama-cpp")


class LlamaCpp(Remote):
    """A llama-server that specbench starts (--engine llama-cpp): the target's GGUF, speculating as
    ``speculation`` says (None: the baseline, or the draft alone when ``draft_alone``). Its
    ``command`` is filled in once the run knows the GGUF files and the context a request needs."""

    engine = "llama-cpp"
    server_per_k = True

    def __init__(self, name: str, spec_type: str = "", draft_sampling: str = "", draft_alone: bool = False):
        super().__init__(name, "", speculates=bool(spec_type))
        self.spec_type, self.draft_sampling, self.draft_alone = spec_type, draft_sampling, draft_alone
        self.needs_draft = spec_type == "draft-simple"
        self.needs_speculator = spec_type == "draft-eagle3"
        self.help = LLAMA_HELP.get(name, f"llama.cpp's --spec-type {spec_type}")

    def c(self, costs):
        return 0.0 if self.spec_type.startswith("ngram") else super().c(costs)

    def speculation(self, k: int, draft, head) -> Speculation | None:
        """What its server is started with at lookahead ``k``: the draft's GGUF ``draft`` for a draft
        model, the EAGLE head's ``head`` for EAGLE-3."""
        if not self.takes_k:
            return None
        model = draft if self.needs_draft else head if self.needs_speculator else None
        return Speculation(self.spec_type, k, model, self.draft_sampling or "greedy")


# llama.cpp's n-gram drafters (llama-server --spec-type), each a method of its own name.
LLAMA_NGRAMS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
LLAMA_HELP = {
    "draft-greedy": "llama.cpp's draft model (--spec-type draft-simple), drafts its argmax, verified by matching",
    "draft-probabilistic": "llama.cpp's draft model, drafts sampled and verified by rejection sampling",
    "ngram-simple": "llama.cpp's n-gram lookup in the context (--spec-type ngram-simple)",
    "eagle3": "llama.cpp's EAGLE-3 drafting (--spec-type draft-eagle3) with --speculator's head",
}


def llama_methods(names: list[str], draft_sampling: list[str]) -> list[LlamaCpp]:
    """llama.cpp's methods a --method list asks for: draft (and specbench's speculative) once per
    --draft-sampling mode, ngram (and prompt-lookup) as ngram-simple, llama.cpp's n-gram types by
    name, eagle3 (and specbench's eagle)."""
    picked = []
    for name in names:
        name = METHODS[name].counterpart if name in METHODS else name
        if name == "draft":
            picked += [LlamaCpp(f"draft-{mode}", "draft-simple", mode) for mode in draft_sampling]
        elif name in ("ngram", *LLAMA_NGRAMS):
            spec_type = "ngram-simple" if name == "ngram" else name
            picked.append(LlamaCpp(spec_type, spec_type))
        elif name == "eagle3":
            picked.append(LlamaCpp("eagle3", "draft-eagle3"))
    return list({m.name: m for m in picked}.values())


def llama_method_names() -> tuple[str, ...]:
    """Every --method name --engine llama-cpp takes."""
    return ("draft", "ngram", *LLAMA_NGRAMS, "eagle3", *(n for n, m in METHODS.items() if m.counterpart))
