"""The run configuration: one field per declared option (options.RUN and every method's own).

BenchConfig's field lines are written from the declarations (``python -m specbench.bench.config``), so
an option added to a method appears here, on the command line and in meta.json with no other edit
by hand, and an editor and a type checker see every field. Rules that tie several options together
live in ``validate``; a single option's rules live in its declaration.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from specbench.core.errors import SpecbenchError
from specbench.core.options import (
    ENGINE,
    FIXED,
    LLAMA,
    RUN,
    SERVER,
    SINKS,
    Option,
)
from specbench.engines.llamacpp import find_server
from specbench.engines.vllm import BIND, INSTALL, available, device_count, on_cpu
from specbench.methods.base import Decoder
from specbench.methods.registry import BASELINE, METHOD, METHODS
from specbench.methods.served import (
    SERVED,
    SERVED_BASELINE,
    SERVER_BASELINE,
    SERVER_DRAFT,
    LlamaCpp,
    Remote,
    llama_method_names,
    llama_methods,
    served_names,
)
from specbench.models.names import default_speculator, resolve
from specbench.workloads.prompts import LONG_DATASETS, dataset_kind, datasets_of

# A configuration is built and checked without torch (the command line refuses bad options in well
# under a second): what decodes is imported by the properties that describe it.
if TYPE_CHECKING:
    from specbench.decoding.sampling import Sampling
    from specbench.engines.loop import Settings
    from specbench.models.load import Wanted
    from specbench.models.pair import Rendering


def declared() -> dict[str, Option]:
    """Every run option by name: --method, the common ones, then each method's own (a shared one once)."""
    options = {option.name: option for option in (METHOD, *RUN, *ENGINE, *SERVER, *LLAMA)}
    for method in METHODS.values():
        for option in method.options:
            if options.setdefault(option.name, option) is not option:
                raise TypeError(f"two different options are named {option.name}")
    return options


OPTIONS = declared()


def readers() -> dict[str, tuple[str, ...]]:
    """Who reads each option that not every run reads, as parts of a run (KIND:VALUE, as Option.read_by
    names them): its declaration's ``read_by``, and for a method's own option the methods that list it (and
    --speculator, the methods that need an EAGLE head)."""
    found = {name: list(option.read_by) for name, option in OPTIONS.items() if option.read_by}
    for method in [*METHODS.values(), *SERVED.values()]:
        for name in [o.name for o in method.options] + (["speculator"] if method.needs_speculator else []):
            found.setdefault(name, []).append(f"method:{method.name}")
    return {name: tuple(dict.fromkeys(parts)) for name, parts in found.items()}


READERS = readers()
RUN_NAMES = ("run", "sweep-k", "sweep-context")  # the commands that are `run` (options.RUN_COMMAND)


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def shown(kind: str, values: list[str]) -> str:
    """Parts of a run of one kind as a refusal names them: --engine vllm or server, --dataset longcode."""
    if kind == "dataset":
        return "--dataset " + _either([name for value in values for name in datasets_of(value)])
    if kind == "command":
        commands = [name for value in values for name in (RUN_NAMES if value == "run" else [value])]
        return "specbench " + _either(commands)
    if kind == "weights":
        return _either(["--random-weights" if value == "random" else "checkpoint weights" for value in values])
    return f"--{kind} " + _either(values)


def readers_by_kind(name: str) -> dict[str, list[str]]:
    """The readers of option ``name`` by kind: {"engine": ["server", "llama-cpp"]} (empty: every run)."""
    by_kind: dict[str, list[str]] = {}
    for reader in READERS.get(name, ()):
        kind, _, value = reader.partition(":")
        by_kind.setdefault(kind, []).append(value)
    return by_kind


def read_by(name: str) -> str:
    """Who reads option ``name``, as docs/options.md says it (empty: every run)."""
    return "; by ".join(shown(kind, values) for kind, values in readers_by_kind(name).items())


def fix(kind: str, values: list[str], own: list[str], flag: str) -> str:
    """What a refusal of ``flag``, read only by ``values`` of ``kind`` (the run has ``own``), says to do."""
    if kind == "command":
        return f"drop {flag} (the audit times nothing, and decodes at its own --setting, --greedy-tokens and --length)"
    if kind == "dataset" and "workload" in values and "file" not in values:  # --dataset-path
        return f"drop {flag}" if own == ["file"] else f"a file of your own is --dataset FILE; or drop {flag}"
    add = {
        "method": "add one of them with --method",
        "engine": f"add --engine {values[0]}",
        "dataset": "choose one of those",
        "weights": "add --random-weights",
    }.get(kind, f"add it with --{kind}")
    return f"{add}, or drop {flag}"


LAUNCHED = (SERVER_BASELINE, SERVER_DRAFT)  # --launch names that are not speculating servers

# The shortest --context-tokens of a long dataset. Those datasets measure long prompts, where the
# methods that draft over part of the cache differ from the others; every such view keeps at least
# twice the sinks (--kv-budget's minimum), so a shorter prompt would stay whole in each of them.
MIN_CONTEXT = 2 * SINKS


def option_default(name: str):
    """A configuration field's default: a copy of its option's, so that no two configurations share a list."""
    return field(default_factory=lambda: copy.copy(OPTIONS[name].default))


def fields_source() -> str:
    """BenchConfig's field lines as they must read between its markers: one per option in OPTIONS."""
    return "".join(f'    {name}: {o.annotation} = option_default("{name}")\n' for name, o in OPTIONS.items())


FIELDS_BEGIN, FIELDS_END = "    # the fields, from OPTIONS\n", "    # end of the fields\n"


@dataclass
class BenchConfig:
    """A run's configuration: one field per option in OPTIONS, with its default, and what it derives
    from them. The field lines are written from the declarations (``python -m specbench.bench.config``
    rewrites them; tests/bench/test_bench.py fails while they differ), so an editor and a type checker see
    every field while each option is still declared once, where it belongs."""

    # the fields, from OPTIONS
    methods: list[str] = option_default("methods")
    target: str = option_default("target")
    draft: str = option_default("draft")
    ks: list[int] = option_default("ks")
    k_policies: list[str] = option_default("k_policies")
    draft_p_min: float = option_default("draft_p_min")
    dataset: str = option_default("dataset")
    dataset_path: str | None = option_default("dataset_path")
    prompt_field: str = option_default("prompt_field")
    num_prompts: int | None = option_default("num_prompts")
    categories: list[str] = option_default("categories")
    per_category: int = option_default("per_category")
    max_turns: int = option_default("max_turns")
    group_by: str = option_default("group_by")
    max_new_tokens: int = option_default("max_new_tokens")
    temperature: float = option_default("temperature")
    top_k: int = option_default("top_k")
    top_p: float = option_default("top_p")
    eta: float = option_default("eta")
    seed: int = option_default("seed")
    synthetic_acceptance: float | None = option_default("synthetic_acceptance")
    device: str = option_default("device")
    dtype: str = option_default("dtype")
    repeats: int = option_default("repeats")
    warmup: int = option_default("warmup")
    cost_repeats: int = option_default("cost_repeats")
    threads: int = option_default("threads")
    thinking_markers: str = option_default("thinking_markers")
    chat: str = option_default("chat")
    random_weights: bool = option_default("random_weights")
    prompt_tokens: int = option_default("prompt_tokens")
    assume_alpha: list[float] = option_default("assume_alpha")
    device_map: str | None = option_default("device_map")
    context_tokens: int = option_default("context_tokens")
    compile: bool | None = option_default("compile")
    graphs: bool | None = option_default("graphs")
    prefill_chunk: int = option_default("prefill_chunk")
    engines: list[str] = option_default("engines")
    concurrency: list[int] = option_default("concurrency")
    tensor_parallel_size: int = option_default("tensor_parallel_size")
    pipeline_parallel_size: int = option_default("pipeline_parallel_size")
    distributed_executor_backend: str | None = option_default("distributed_executor_backend")
    engine_args: dict = option_default("engine_args")
    baseline_url: str | None = option_default("baseline_url")
    servers: list[str] = option_default("servers")
    launch: list[str] = option_default("launch")
    draft_url: str | None = option_default("draft_url")
    request_rate: list[float] = option_default("request_rate")
    api: str = option_default("api")
    api_key_env: str = option_default("api_key_env")
    request_timeout: float = option_default("request_timeout")
    llama_server: str | None = option_default("llama_server")
    gguf_type: str = option_default("gguf_type")
    draft_sampling: list[str] = option_default("draft_sampling")
    llama_threads: int = option_default("llama_threads")
    draft_window: int = option_default("draft_window")
    lookup_k: int = option_default("lookup_k")
    lookup_ngram: int = option_default("lookup_ngram")
    cascade_split: int = option_default("cascade_split")
    trees: list[str] = option_default("trees")
    online_every: int = option_default("online_every")
    online_steps: int = option_default("online_steps")
    online_lr: float = option_default("online_lr")
    save_draft: str | None = option_default("save_draft")
    kv_budget: int = option_default("kv_budget")
    kv_policy: str = option_default("kv_policy")
    inner_k: int = option_default("inner_k")
    speculator: str | None = option_default("speculator")
    dynamic_nodes: int = option_default("dynamic_nodes")
    dynamic_width: int = option_default("dynamic_width")
    # end of the fields

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(int(b) for b in tree.split(",")) for tree in self.trees]

    @property
    def plan(self) -> list[Decoder]:
        """What specbench's loop decodes per prompt after the baseline: each method at each K with each
        --k-policy it takes, or each tree shape (nothing when --engine leaves torch out)."""
        if "torch" not in self.engines:
            return []
        steps = []
        # A method timed against its engine's own baseline (hf-assisted: hf-generate) brings it along.
        names = [n for name in self.methods if name in METHODS for n in (METHODS[name].reference, name) if n]
        for method in (METHODS[name] for name in dict.fromkeys(names) if name != BASELINE.name):
            if method.takes_tree:
                steps += [Decoder(method, len(shape), shape) for shape in self.shapes]
            elif method.takes_k:
                steps += [Decoder(method, k, k_policy=policy) for k in self.ks for policy in self.policies(method)]
            else:
                steps += [Decoder(method)]
        return steps

    def policies(self, method) -> list[str]:
        """The --k-policy values ``method`` decodes with: those it can take, or fixed K when it takes none."""
        return [policy for policy in self.k_policies if policy in method.k_policies] or [FIXED]

    @property
    def policy_notes(self) -> list[str]:
        """A line for each method of the run that drafts but cannot take every --k-policy asked for."""
        own = [(decoder.method, decoder.method.name) for decoder in self.plan]
        served = [(decoder.method, f"{decoder.method.engine} {decoder.method.name}") for decoder in self.served_plan]
        lines = []
        for method, who in dict.fromkeys(own + served):
            dropped = [policy for policy in self.k_policies if policy not in method.k_policies]
            if method.drafts and dropped:
                lines.append(
                    f"{who} takes only --k-policy {', '.join(method.k_policies)}: no {', '.join(dropped)} rows"
                )
        return lines

    @property
    def budget_notes(self) -> list[str]:
        """A line when --kv-budget holds the whole --context-tokens: the methods that draft over a part
        of the target's cache then draft over all of it, and measure nothing a sparse cache saves."""
        context = self.context_tokens if self.dataset in LONG_DATASETS else 0
        if not 0 < context <= self.kv_budget or self.unread("kv_budget") is not None:
            return []
        methods = [m for m in self.methods if m in readers_by_kind("kv_budget").get("method", [])]
        return [
            f"--kv-budget {self.kv_budget} holds all {context} tokens of the context: {', '.join(methods)} "
            f"draft over the whole cache here; a budget below {context} drafts over a part of it"
        ]

    @property
    def served_plan(self) -> list[Decoder]:
        """What each serving engine after its baseline decodes: under vLLM a method at each K (one
        engine each); under --engine server each --server (its K is what it says, else a single --k);
        under --engine llama-cpp a llama-server per method and K."""
        if "llama-cpp" in self.engines:
            # A method object per K: each is a server of its own, with its own command line.
            methods = llama_methods(self.methods, self.draft_sampling)
            return [Decoder(copy.copy(method), k) for method in methods for k in self.ks]
        if "server" in self.engines:
            k = self.ks[0] if len(self.ks) == 1 else None
            plan = [Decoder(Remote(name, url), k) for name, url in self.server_entries]
            for name, command in self.launches.items():
                if name in LAUNCHED:
                    continue
                if "{k}" in command:  # a server per K, each started with its K in the command
                    plan += [Decoder(Remote(name, "", command=command.replace("{k}", str(n)), launched_k=n), n)
                             for n in self.ks]  # fmt: skip
                else:
                    plan.append(Decoder(Remote(name, "", command=command), k))
            return plan
        if "vllm" not in self.engines:
            return []
        return [Decoder(SERVED[name], k) for name in served_names(self.methods) for k in self.ks]

    @property
    def served_baseline(self) -> Decoder | None:
        """The serving engine's baseline, every served method's reference (None: no serving engine)."""
        if "llama-cpp" in self.engines:
            return Decoder(LlamaCpp(SERVER_BASELINE))
        if "server" in self.engines:
            command = self.launches.get(SERVER_BASELINE, "")
            return Decoder(Remote(SERVER_BASELINE, self.baseline_url or "", False, command))
        return Decoder(SERVED_BASELINE) if "vllm" in self.engines else None

    @property
    def server_entries(self) -> list[tuple[str, str]]:
        """--server NAME=URL as (name, url) pairs."""
        return [tuple(part.strip() for part in entry.split("=", 1)) for entry in self.servers if "=" in entry]

    @property
    def launches(self) -> dict[str, str]:
        """--launch NAME=COMMAND by name, ``{draft}`` filled in with where --draft is (``{port}`` and
        ``{k}`` are filled in when each server starts)."""
        draft = resolve(self.draft).location if self.draft and any("{draft}" in e for e in self.launch) else ""
        return {
            name.strip(): command.strip().replace("{draft}", draft)
            for name, command in (entry.split("=", 1) for entry in self.launch if "=" in entry)
        }

    @property
    def draft_server(self) -> Remote | None:
        """The server of the draft alone, for c: --draft-url, or the one --launch draft=... starts (under
        --engine llama-cpp, a llama-server of the draft's GGUF when a method drafts with it)."""
        if "llama-cpp" in self.engines:
            drafts = any(decoder.method.needs_draft for decoder in self.served_plan)
            return LlamaCpp(SERVER_DRAFT, draft_alone=True) if drafts else None
        if self.draft_url or SERVER_DRAFT in self.launches:
            return Remote(SERVER_DRAFT, self.draft_url or "", False, self.launches.get(SERVER_DRAFT, ""))
        return None

    @property
    def loads(self) -> list[tuple[int, float]]:
        """The loads a serving engine is measured at: each --concurrency with each --request-rate."""
        return [(n, rate) for n in self.concurrency for rate in self.request_rate]

    @property
    def widest(self) -> int:
        """Most tokens in one target forward: K + 1 for a chain (a method's longest draft + 1 where it
        drafts more, as lookup-or-draft's lookup rounds may), the tree's nodes + 1 for a tree. (A
        heuristic K grows past it, but never drafts beyond the tokens still to generate: the caches
        stay within the prompt, --max-new-tokens and this.)"""
        from specbench.drafters.propose import tree_parents

        return 1 + max(
            [max(self.ks)]
            + [len(tree_parents(decoder.tree)) for decoder in self.plan if decoder.tree]
            + [decoder.method.longest_draft(self, decoder.k) for decoder in self.plan if decoder.k]
        )

    @property
    def needs_draft(self) -> bool:
        return any(decoder.method.needs_draft for decoder in self.plan + self.served_plan)

    @property
    def wanted(self) -> Wanted:
        """The models this run loads: the draft only when a method needs it, the weights only when
        specbench's loop decodes (vLLM loads its own)."""
        from specbench.models.load import Wanted

        draft = self.draft if self.needs_draft else None
        return Wanted(
            self.target,
            draft,
            self.device,
            self.dtype,
            self.device_map,
            self.random_weights,
            self.seed,
            bool(self.plan),
            self.speculator if self.needs_speculator else None,
        )

    @property
    def rendering(self) -> Rendering:
        """How this run's prompts become token ids."""
        from specbench.models.pair import Rendering

        context = self.context_tokens if self.dataset in LONG_DATASETS else 0
        return Rendering(
            self.max_new_tokens, self.widest, self.chat, context, self.random_weights, self.prompt_tokens, self.seed
        )

    @property
    def needs_speculator(self) -> bool:
        """Whether an EAGLE head decodes in specbench's loop (vLLM loads its own)."""
        return any(decoder.method.needs_speculator for decoder in self.plan)

    @property
    def learns(self) -> bool:
        return any(decoder.method.learns for decoder in self.plan)

    @property
    def sampling(self) -> Sampling:
        """The run's sampling: the warp, the tokens to generate and the seed."""
        from specbench.decoding.sampling import Sampling

        return Sampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            eta=self.eta,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            synthetic_acceptance=self.synthetic_acceptance,
        )

    def requests(self, stop_ids) -> Sampling:
        """What every engine samples with: the run's sampling and the ids that end an answer
        (``stop_ids``, the target's)."""
        return replace(self.sampling, stop_ids=tuple(sorted(stop_ids)))

    def options_of(self, method) -> dict:
        """The options ``method`` decodes with in specbench's loop: its own, and --draft-p-min (where
        the confidence policy stops a round)."""
        return {name: getattr(self, name) for name in [o.name for o in method.options] + ["draft_p_min"]}

    def settings_of(self, method) -> Settings:
        """engines/loop.Settings of ``method`` in this run (what begin_run and the cost levels take)."""
        from specbench.engines.loop import Settings

        return Settings(self.max_new_tokens, self.sampling, self.options_of(method))

    def parts(self, command: str = "run") -> dict[str, list[str]]:
        """What this run is, by kind, as options name their readers (Option.read_by): the command
        (run stands for sweep-k and sweep-context too), the kind of its dataset, its weights, and its
        engines, methods and --k-policy values."""
        return {
            "command": [command],
            "dataset": [dataset_kind(self.dataset)],
            "weights": ["random" if self.random_weights else "checkpoint"],
            "engine": list(self.engines),
            "method": list(self.methods),
            "k-policy": list(self.k_policies),
        }

    def unread(self, name: str, command: str = "run") -> str | None:
        """Why this run (of ``command``) does not read option ``name``, as its refusal says it; None when
        it reads it: for each kind of part among the option's readers, the run has one of them."""
        parts, option = self.parts(command), OPTIONS[name]
        for kind, values in readers_by_kind(name).items():
            own = parts[kind]
            if not set(values) & set(own):
                this = f"--dataset {self.dataset}" if kind == "dataset" else shown(kind, own)
                given = getattr(self, name)
                flag = f"--no-{option.flag[2:]}" if option.is_flag and given is False else option.flag
                return f"{flag} is read only by {shown(kind, values)}, not by {this}: {fix(kind, values, own, flag)}"
        return None

    def refuse_unread_options(self, command: str = "run") -> None:
        """An option set away from its default in a run that does not read it would be ignored without a
        word (--dataset-path with --dataset humaneval, --kv-budget with speculative alone, --tensor-parallel-size
        without vLLM): refuse it, naming who reads it. Each option says who reads it (Option.read_by)."""
        for name in READERS:
            if getattr(self, name) != OPTIONS[name].default and (why := self.unread(name, command)) is not None:
                raise SpecbenchError(why)

    def validate(self, command: str = "run") -> None:
        """Refuse what this configuration cannot run, each in one line, before anything loads; ``command``
        is the one it runs under (run, for sweep-k and sweep-context too; audit)."""
        if "llama-cpp" in self.engines:
            self.validate_llama_cpp()
        elif unknown := [name for name in self.methods if name not in METHODS and name not in SERVED]:
            raise SpecbenchError(
                f"unknown --method {', '.join(unknown)}: choose from {', '.join(METHODS)} "
                f"(or, with --engine vllm, {', '.join(SERVED)})"
            )
        for option in OPTIONS.values():
            option.validate(getattr(self, option.name))
        for name in self.methods:  # a method's rules that tie its own options to the others
            if name in METHODS:
                METHODS[name].check_options(self)
        self.refuse_unread_options(command)
        if "llama-cpp" in self.engines:
            heads = [decoder.method.name for decoder in self.served_plan if decoder.method.needs_speculator]
        else:
            heads = [name for name in self.methods if (METHODS.get(name) or SERVED[name]).needs_speculator]
        if heads and not self.speculator:  # the target's own head, where models.toml names one
            self.speculator = default_speculator(self.target)
        if heads and not self.speculator:
            raise SpecbenchError(
                f"--method {heads[0]} needs --speculator PATH: an EAGLE-3 head's checkpoint directory "
                "(`specbench distill --kind eagle` trains one)"
            )
        self.validate_synthetic()
        self.validate_engines()
        long = self.dataset in LONG_DATASETS
        problems = [
            (
                self.device_map is not None and self.random_weights,
                "--device-map places a checkpoint's weights as it loads them: with --random-weights use --device",
            ),
            (
                long and not self.context_tokens,
                f"--dataset {' / '.join(LONG_DATASETS)} takes its prompt length from --context-tokens N",
            ),
            (
                long and 0 < self.context_tokens < MIN_CONTEXT,
                f"--context-tokens {self.context_tokens} is too short for --dataset {self.dataset}, which measures long "
                f"prompts: every partial view of the cache keeps at least {MIN_CONTEXT} tokens, so a shorter prompt "
                f"stays whole in each; give {MIN_CONTEXT} or more, or a dataset of short prompts such as humaneval",
            ),
            (
                self.graphs is True and self.compile is False,
                "--graphs compiles its forwards (torch.compile), so --no-compile would go unheard: drop one "
                "(--no-compile alone runs transformers' eager forward)",
            ),
            (
                self.random_weights and self.learns,
                "--method online learns from the target's rows, which mean nothing with --random-weights: drop one",
            ),
        ]
        for bad, message in problems:
            if bad:
                raise SpecbenchError(message)

    def validate_synthetic(self) -> None:
        """--synthetic-acceptance: only where a chain's drafts can be kept by rate instead of verified,
        specbench's loop, vLLM's engines (its synthetic rejection sampler, on a GPU: bench/run.py checks the
        device) and the llama-servers specbench starts."""
        acceptance = self.synthetic_acceptance
        if acceptance is None:
            return
        if other := [engine for engine in self.engines if engine not in ("torch", "vllm", "llama-cpp")]:
            raise SpecbenchError(
                f"--synthetic-acceptance with --engine {other[0]}: specbench sets it only in its own loop, in vLLM "
                "and in the llama-servers it starts (--engine llama-cpp); give a server its own flags instead "
                "(vLLM's synthetic_acceptance_rates, llama-server's --spec-synth-rates)"
            )
        if acceptance >= 1 and (short := [k for k in self.ks if acceptance > k + 1]):
            raise SpecbenchError(
                f"--synthetic-acceptance {acceptance:g} tokens per round: a round of K = {short[0]} yields at most "
                f"{short[0] + 1}; lower it, or raise --k"
            )
        if "llama-cpp" in self.engines:
            return  # every llama-server drafter is a chain
        if self.learns:
            raise SpecbenchError(
                "--synthetic-acceptance keeps drafts at a set rate, so what --method online learns never shows in "
                "its acceptance: drop one of them"
            )
        for name in self.methods:
            method = METHODS.get(name)
            # A level beneath the drafter is verified by the drafter, through the same rule: keep it exact.
            if (
                method is not None
                and method.drafts
                and (method.engine != "torch" or not method.chains or method.inner_level)
            ):
                raise SpecbenchError(
                    f"--synthetic-acceptance keeps a prefix of one chain of drafts, and --method {name} does not "
                    "verify one in specbench's loop: drop one of them"
                )

    def validate_engines(self) -> None:
        """What --engine allows: every error here comes before any model loads or engine starts."""
        vllm, llama = "vllm" in self.engines, "llama-cpp" in self.engines
        server = "server" in self.engines or llama
        if server and len(self.engines) > 1:
            alone = "llama-cpp" if llama else "server"
            raise SpecbenchError(f"--engine {alone} runs alone: measure the other engines in a run of their own")
        for name in [] if llama else self.methods:  # llama.cpp's names were checked by validate_llama_cpp
            if name in SERVED and name not in METHODS and not vllm:
                own = [m.name for m in METHODS.values() if m.counterpart == name]
                hint = f" (specbench's own is {own[0]})" if own else ""
                raise SpecbenchError(f"--method {name} is vLLM's: add --engine vllm{hint}")
            if vllm and "torch" not in self.engines and name in METHODS and name not in SERVED:
                if not METHODS[name].counterpart:
                    raise SpecbenchError(
                        f"--method {name} does not run in vLLM: choose from {', '.join(SERVED)}, "
                        "or add torch to --engine"
                    )
        if "torch" in self.engines and max(self.concurrency) > 1:
            raise SpecbenchError(
                "specbench's loop decodes one request at a time: --concurrency above 1 needs --engine vllm or server"
            )
        if "torch" in self.engines and self.request_rate != OPTIONS["request_rate"].default:
            raise SpecbenchError("--request-rate sends requests to a serving engine: add --engine vllm or server")
        if not (vllm or server):
            return
        prompts = self.num_prompts or (None if self.per_category else 10)  # --per-category: known once read
        if prompts is not None and max(self.concurrency) > prompts:
            raise SpecbenchError(
                f"--concurrency {max(self.concurrency)} keeps that many requests in flight and needs as many prompts: "
                f"raise --num-prompts to {max(self.concurrency)} or more (twice as many measure a steady state)"
            )
        if self.eta:
            raise SpecbenchError(f"{'servers have' if server else 'vLLM has'} no eta sampling: drop --eta")
        if llama:
            return
        if server:
            self.validate_servers()
            return
        for decoder in self.served_plan:
            decoder.method.check_served(self)
        cpu = on_cpu(self.device)
        if self.pipeline_parallel_size > 1 and self.served_plan and cpu:
            raise SpecbenchError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size} with speculation ({self.served_plan[0].label}): "
                "vLLM's CPU worker cannot draft across pipeline stages (its engine fails to start): split the "
                "model with --tensor-parallel-size instead"
            )
        devices = self.tensor_parallel_size * self.pipeline_parallel_size
        count, what = device_count(self.device)
        # On a CPU specbench binds each worker to cores of its own (engines/vllm.py: cpu_binding), unless
        # the user bound them (VLLM_CPU_OMP_THREADS_BIND), which vLLM then judges.
        bound = cpu and os.environ.get(BIND) is not None
        if devices > count and self.distributed_executor_backend != "ray" and not bound:
            bind = f", bind vLLM's workers to cores yourself with {BIND}," if cpu else ","
            raise SpecbenchError(
                f"--tensor-parallel-size {self.tensor_parallel_size} x --pipeline-parallel-size "
                f"{self.pipeline_parallel_size} needs {devices} devices and this machine has {count} {what}: "
                f"lower them{bind} or spread over machines with --distributed-executor-backend ray"
            )
        if not available():
            raise SpecbenchError(INSTALL)

    def validate_llama_cpp(self) -> None:
        """--engine llama-cpp's own rules: llama.cpp's methods, real weights, and a llama-server to start."""
        if len(self.engines) > 1:
            raise SpecbenchError("--engine llama-cpp runs alone: measure the other engines in a run of their own")
        if unknown := [name for name in self.methods if name not in llama_method_names()]:
            raise SpecbenchError(
                f"--method {unknown[0]} does not run in llama.cpp: choose from draft, ngram (or llama.cpp's "
                "ngram-map-k, ngram-map-k4v, ngram-mod) and eagle3"
            )
        if not self.served_plan:
            raise SpecbenchError("--engine llama-cpp needs a speculative --method: draft, ngram or eagle3")
        if self.random_weights:
            raise SpecbenchError("--random-weights is for specbench's loop and vLLM: llama.cpp needs the weights")
        find_server(self.llama_server)

    def validate_servers(self) -> None:
        """--engine server's own rules: a baseline, NAME=URL entries with distinct names, http(s) URLs."""
        for flag, entries, example in (
            ("--server", self.servers, "eagle3=http://127.0.0.1:8001/v1"),
            (
                "--launch",
                self.launch,
                "baseline='python -m vllm.entrypoints.openai.api_server --model M --port {port}'",
            ),
        ):
            if bad := [entry for entry in entries if "=" not in entry or not entry.split("=", 1)[0].strip()]:
                raise SpecbenchError(f"{flag} {bad[0]}: give NAME=..., e.g. {flag} {example}")
        launched = [entry.split("=", 1)[0].strip() for entry in self.launch]
        for name, entry in zip(launched, self.launch, strict=True):
            if "{k}" in entry and name in LAUNCHED:
                raise SpecbenchError(f"--launch {name}=...: the {name} server does not speculate, so it takes no {{k}}")
        if bool(self.baseline_url) == (SERVER_BASELINE in self.launches):
            raise SpecbenchError(
                "--engine server needs one baseline, a server running the target alone: --baseline-url URL "
                "(e.g. http://127.0.0.1:8000/v1) or --launch baseline=COMMAND"
            )
        if self.draft_url and SERVER_DRAFT in self.launches:
            raise SpecbenchError("give the draft's server once: --draft-url or --launch draft=..., not both")
        if not self.served_plan:
            raise SpecbenchError(
                "--engine server needs at least one server that speculates: --server NAME=URL or --launch NAME=COMMAND"
            )
        names = [name for name, _ in self.server_entries] + [name for name in launched if name not in LAUNCHED]
        if dupes := sorted({name for name in names if names.count(name) > 1} | ({SERVER_BASELINE} & set(names))):
            raise SpecbenchError(f"--server {dupes[0]}: each server needs a name of its own, and not 'baseline'")
        for given, url in (
            [(f"--baseline-url {self.baseline_url}", self.baseline_url)]
            + [(f"--draft-url {self.draft_url}", self.draft_url)]
            + [(f"--server {name}={url}", url) for name, url in self.server_entries]
        ):
            if url is not None and not url.startswith(("http://", "https://")):
                raise SpecbenchError(f"{given}: give the API's URL, e.g. http://127.0.0.1:8000/v1")

    def as_dict(self) -> dict:
        return asdict(self)


def write_fields(path: str = __file__) -> bool:
    """Rewrite BenchConfig's field lines in ``path`` from OPTIONS; whether they changed."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(FIELDS_BEGIN) + len(FIELDS_BEGIN), text.index(FIELDS_END)
    if text[start:end] == fields_source():
        return False
    with open(path, "w") as f:
        f.write(text[:start] + fields_source() + text[end:])
    return True


if __name__ == "__main__":
    print("rewrote BenchConfig's fields" if write_fields() else "BenchConfig's fields are those of OPTIONS")
