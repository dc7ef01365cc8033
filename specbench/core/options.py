"""Every option of a run, declared once: its name, default, help, choices and validation.

The run configuration (bench/config.py) has one field per option, the command line one flag per option
(cli/app.py), and `specbench list` shows them; a method declares the options it owns next to its class
(methods/registry.py) with the same Option. Nothing here imports the rest of specbench.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specbench.core.errors import SpecbenchError

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"
# The first tokens every partial view of a KV cache keeps (TriForce's tiny draft keeps 16; its retrieval
# keeps chunk 0): the least of --kv-budget and --draft-window are set by it (decoding/kv.py).
SINKS = 16


def items(text: str) -> list[str]:
    """The comma-separated items of ``text``, stripped. An empty one is refused: "1,,2" or a trailing
    comma is more likely a slip than a list of two."""
    parts = [part.strip() for part in text.split(",")]
    if "" in parts:
        raise ValueError("has an empty item (two commas in a row, or one at an end): remove it")
    return parts


def int_list(text: str) -> list[int]:
    """Sorted distinct integers from comma-separated text, e.g. "4" or "1,2,4"."""
    parts = items(text)
    try:
        values = sorted({int(part) for part in parts})
    except ValueError:
        raise ValueError("is not an integer or a comma-separated list of integers, e.g. 1,2,3,4") from None
    if not values:
        raise ValueError("is empty: give a number such as 4 or a list such as 1,2,3,4")
    return values


def float_list(text: str) -> list[float]:
    parts = items(text)
    try:
        return [float(part) for part in parts]
    except ValueError:
        raise ValueError("is not a comma-separated list of numbers, e.g. 0.5,0.6,0.7") from None


@dataclass(frozen=True)
class Option:
    """One option. ``name`` is the configuration field; the flag is --name-with-dashes (or ``flags``).

    The default's type is the option's type, unless ``parse`` reads the command line's text into
    the value (lists) or ``repeat`` collects a repeatable flag. ``choices`` are shown in --help and
    enforced, ``low`` is an inclusive minimum (of every element of a list), ``check`` any other rule
    with ``problem`` the error it gives; a number must be finite unless ``infinite`` (inf is a value
    it takes). ``recorded`` options of a method go into its summary's
    ``options`` column. ``read_by`` says which parts of a run read it (bench/config.py: READERS): none
    of them, of any one kind, refuses it set away from its default; a method's own options are read
    by the methods that list them.
    """

    name: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    low: float | None = None
    infinite: bool = False
    check: Callable[[Any], bool] | None = None
    problem: str = ""
    flags: tuple[str, ...] = ()
    metavar: str = ""
    parse: Callable[[str], Any] | None = None
    repeat: Callable[[list[str]], list[str]] | None = None
    kind: type = str  # the type of an option whose default is None, or of a list's elements when it is empty
    recorded: bool = True
    panel: str = ""  # the --help section it is listed in (empty: the general options, or its method's)
    read_by: tuple[str, ...] = ()  # the parts of a run that read it, KIND:VALUE (empty: every run)

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else "--" + self.name.replace("_", "-")

    @property
    def type(self) -> type:
        """The configuration value's type."""
        return self.kind | None if self.default is None else type(self.default)

    @property
    def is_flag(self) -> bool:
        """Given as --name / --no-name: a bool, or a bool that is None until the run resolves it (--compile)."""
        return self.type is bool or (self.default is None and self.kind is bool)

    @property
    def annotation(self) -> str:
        """The configuration field's type as bench/config.py declares it (a list's elements named)."""
        if self.default is None:
            return f"{self.kind.__name__} | None"
        if isinstance(self.default, list):
            kinds = sorted({type(value).__name__ for value in self.default} or {self.kind.__name__})
            return f"list[{' | '.join(kinds)}]"
        return type(self.default).__name__

    @property
    def text_default(self) -> Any:
        """The default as the command line gives it: text for parsed lists, None for repeatable flags."""
        if self.repeat is not None:
            return None
        if self.parse is not None:
            return ",".join(map(str, self.default)) if isinstance(self.default, list) else str(self.default or "")
        return self.default

    def value(self, given: Any) -> Any:
        """The configuration value of what the command line gave."""
        try:
            if self.repeat is not None:
                return self.repeat(given) if given else list(self.default)
            if self.parse is not None and isinstance(given, str):
                return self.parse(given) if given.strip() else copy.copy(self.default)
        except ValueError as e:
            shown = ",".join(given) if isinstance(given, list) else given
            raise SpecbenchError(f"{self.flag} {shown!r} {e}") from None
        return None if given == "" and self.default is None else given

    def validate(self, value: Any) -> None:
        values = value if isinstance(value, list) else [value]
        if value is None:
            return
        if self.choices and not all(v in self.choices for v in values):
            shown = ",".join(map(str, values))
            raise SpecbenchError(self.problem or f"{self.flag} {shown}: use one of {', '.join(self.choices)}")
        numbers = [v for v in values if isinstance(v, float)]
        if not all(math.isfinite(v) or (self.infinite and v == math.inf) for v in numbers):
            shown = ",".join(map(str, values))
            raise SpecbenchError(f"{self.flag} {shown}: give a finite number")
        if self.low is not None and not all(v >= self.low for v in values):
            raise SpecbenchError(self.problem or f"{self.flag} must be >= {self.low:g}")
        if self.check is not None and not self.check(value):
            raise SpecbenchError(self.problem)


def name_list(text: str) -> list[str]:
    """Distinct names in order from comma-separated text, e.g. "torch,vllm"."""
    return list(dict.fromkeys(items(text)))


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"is not valid JSON ({e.msg} at character {e.pos}): give an object such as '{{\"enforce_eager\": true}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError("is not a JSON object: give one such as '{\"enforce_eager\": true}'")
    return value


def names_given(given: list[str]) -> list[str]:
    """A repeatable flag of names, --method a,b --method c: the names in order, once each."""
    return list(dict.fromkeys(name for value in given for name in items(value)))


# How a method's lookahead is chosen round by round (--k-policy); methods/registry.py says which methods take which.
FIXED, HEURISTIC, CONFIDENCE = "fixed", "heuristic", "confidence"
K_POLICIES = (FIXED, HEURISTIC, CONFIDENCE)


# Who reads an option (Option.read_by): parts of a run, KIND:VALUE; bench/config.py says which parts a run
# has. An option is read when the run has, for each kind among its readers, one of them: --engine-args only
# by --engine vllm, --repeats only by specbench's loop (--engine torch) in a run (the audit times nothing).
TORCH, VLLM, SERVER_ENGINE, LLAMA_CPP = "engine:torch", "engine:vllm", "engine:server", "engine:llama-cpp"
# --dataset: a local file; a named workload read from its file (spec-bench, mt-bench, speed-bench, sharegpt);
# a built-in set of single prompts (humaneval, xsum, pydoc); a long dataset made here (longcode).
FILE, WORKLOAD, BUILT_IN, LONG = "dataset:file", "dataset:workload", "dataset:built-in", "dataset:long"
FILES = (WORKLOAD, FILE)  # the datasets read from a file: conversations, with categories
RUN_COMMAND = "command:run"  # run, sweep-k and sweep-context; not the audit, which decodes at its own settings
RANDOM_WEIGHTS = "weights:random"
CONFIDENCE_POLICY = f"k-policy:{CONFIDENCE}"

# --help's panels of the run's options, by purpose (the engines', the audit's and each method's follow).
COMPARE_PANEL = "What to compare: methods, models, the lookahead K"
WORKLOAD_PANEL = "Workload: the prompts"
DECODING_PANEL = "Decoding: sampling, device, precision, forward"
TIMING_PANEL = "Timing and repeats"
OUTPUT_PANEL = "Output"

# The options of every run, in the order --help lists them; a method's own options follow them.
RUN: tuple[Option, ...] = (
    Option(
        "target",
        DEFAULT_TARGET,
        "Target model: alias from configs/models.toml, hub id, local dir or .gguf file.",
        panel=COMPARE_PANEL,
    ),
    Option(
        "draft",
        DEFAULT_DRAFT,
        "Draft model (same forms as --target): with the target's tokenizer, or with its own for the methods that "
        "draft across vocabularies (speculative-intersection, speculative-text, hf-universal).",
        panel=COMPARE_PANEL,
    ),
    Option(
        "ks",
        [4],
        "Lookahead (draft tokens per verification); a comma-separated list sweeps, e.g. 1,2,4.",
        flags=("--k", "--ks"),
        parse=int_list,
        low=1,
        problem="K must be at least 1 (--k)",
        panel=COMPARE_PANEL,
    ),
    Option(
        "k_policies",
        [FIXED],
        "How K is chosen round by round, repeatable or comma-separated (a row each): fixed (K every round); "
        "heuristic (K first, then K+2 after a round whose drafts were all accepted, else K-1: transformers' "
        "schedule); confidence (at most K, stopping before the first token whose draft probability is below "
        "--draft-p-min: llama.cpp's rule). A method that cannot take a policy runs fixed (docs/methods.md).",
        flags=("--k-policy",),
        repeat=names_given,
        choices=K_POLICIES,
        panel=COMPARE_PANEL,
    ),
    Option(
        "draft_p_min",
        0.4,
        "--k-policy confidence: a round stops drafting where the draft's most likely token has a lower "
        "probability (its warped distribution under sampling, the softmax of its logits under greedy).",
        check=lambda p: 0 < p <= 1,
        problem="--draft-p-min must be in (0, 1]",
        read_by=(CONFIDENCE_POLICY,),
        panel=COMPARE_PANEL,
    ),
    Option(
        "dataset",
        "humaneval",
        "humaneval, xsum, pydoc, longcode; the workloads spec-bench, mt-bench, speed-bench (speed-bench:CONFIG, e.g. "
        "speed-bench:throughput_2k) and sharegpt; or a local .jsonl/.json/.csv/.parquet file, read by its fields "
        "(turns, messages, conversations, or --prompt-field). `specbench list datasets` says where each comes from.",
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "dataset_path",
        None,
        "The file of a named workload (spec-bench, mt-bench, speed-bench, sharegpt) when it is not in its default "
        "place, ~/.cache/specbench/datasets/NAME/.",
        read_by=(WORKLOAD,),
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "prompt_field",
        "prompt",
        "Field holding the prompt in a local dataset file of single prompts.",
        read_by=FILES,
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "num_prompts",
        None,
        "How many prompts (conversations), from the start of the dataset or of what --category and --per-category "
        "select; by default 10 (sweep-context: 4), or every prompt that --per-category draws.",
        low=1,
        kind=int,
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "categories",
        [],
        "Only prompts of these categories, repeatable or comma-separated (an unknown one lists the dataset's).",
        flags=("--category",),
        repeat=names_given,
        read_by=FILES,
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "per_category",
        0,
        "Draw this many prompts of each category, seeded by --seed, so that a short run covers every category (0: off).",
        low=0,
        problem="--per-category must be >= 0 (0 turns it off)",
        read_by=FILES,
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "max_turns",
        0,
        "Decode at most this many user turns of each conversation (0: all); each turn is a row of its own.",
        low=0,
        problem="--max-turns must be >= 0 (0: every turn)",
        read_by=(*FILES, RUN_COMMAND),
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "group_by",
        "category",
        "What categories.csv, the category table and categories.png group the prompts by: category, sub_category, "
        "turn (of a conversation) or input_length (SPEED-Bench's configured length, else the prompt's length rounded "
        "up to a power of two).",
        choices=("category", "sub_category", "turn", "input_length"),
        read_by=(RUN_COMMAND,),
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "max_new_tokens",
        64,
        "Tokens to generate per prompt (decoding also stops at EOS).",
        low=1,
        read_by=(RUN_COMMAND,),
        panel=DECODING_PANEL,
    ),
    Option(
        "temperature",
        0.0,
        "0 = greedy (exact argmax); > 0 samples.",
        low=0,
        problem="--temperature must be >= 0 (0 means greedy)",
        read_by=(RUN_COMMAND,),
        panel=DECODING_PANEL,
    ),
    Option(
        "top_k",
        0,
        "Keep the k most likely tokens (0 = off).",
        low=0,
        problem="--top-k must be >= 0 (0 turns it off)",
        read_by=(RUN_COMMAND,),
        panel=DECODING_PANEL,
    ),
    Option(
        "top_p",
        1.0,
        "Nucleus sampling mass (1.0 = off).",
        check=lambda p: 0 < p <= 1,
        problem="--top-p must be in (0, 1]",
        read_by=(RUN_COMMAND,),
        panel=DECODING_PANEL,
    ),
    Option(
        "eta",
        0.0,
        "Eta sampling's epsilon, applied to target and draft alike after top-k and top-p (0 = off).",
        check=lambda e: 0 <= e < 1,
        problem="--eta must be in [0, 1) (0 turns it off)",
        read_by=(RUN_COMMAND,),
        panel=DECODING_PANEL,
    ),
    Option(
        "seed",
        0,
        "Base seed; each prompt's generators derive from (seed, prompt index, method).",
        low=0,
        problem="--seed must be >= 0 (llama.cpp and vLLM read -1 as a random seed, which no run can repeat)",
        panel=DECODING_PANEL,
    ),
    Option(
        "synthetic_acceptance",
        None,
        "Benchmarking only, not exact: instead of verifying, accept each draft token with this probability "
        "(a rate below 1), or with the rate that makes this the mean tokens per round (a length from 1 to K + 1), "
        "then take the target's own token. Measures a loop's overhead at a known acceptance against the speedup "
        "formula. specbench's loop (chain methods), llama.cpp (--spec-synth-rates) and vLLM on a GPU (its synthetic "
        "rejection sampler); the rows say so, and their outputs are not compared with the baseline's.",
        kind=float,
        check=lambda a: a >= 0,
        problem="--synthetic-acceptance must be >= 0: a rate below 1, or a mean of tokens per round from 1 to K + 1",
        panel=DECODING_PANEL,
    ),
    Option(
        "device",
        "auto",
        "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.",
        metavar="[auto|cpu|cuda|cuda:N|mps]",
        check=lambda d: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", d) is not None,
        problem="--device: use auto, cpu, cuda, cuda:N or mps",
        panel=DECODING_PANEL,
    ),
    Option(
        "dtype",
        "auto",
        "auto (bfloat16 on cuda, float16 on GPUs without native bfloat16 and on mps, float32 on cpu), float32, "
        "bfloat16 or float16.",
        choices=("auto", "float32", "bfloat16", "float16"),
        panel=DECODING_PANEL,
    ),
    Option(
        "repeats",
        1,
        "Timed repeats per prompt and method; the median run is kept whole (of an even count, the faster of the middle two).",
        low=1,
        read_by=(TORCH, RUN_COMMAND),
        panel=TIMING_PANEL,
    ),
    Option(
        "warmup",
        1,
        "Untimed warm-up passes over the first prompt before timing.",
        low=0,
        read_by=(RUN_COMMAND,),
        panel=TIMING_PANEL,
    ),
    Option(
        "cost_repeats",
        10,
        "Repeats per forward-cost measurement (c, verify_ratio).",
        low=1,
        read_by=(TORCH, RUN_COMMAND),
        panel=TIMING_PANEL,
    ),
    Option(
        "threads",
        0,
        "CPU threads for torch (0: torch's default, one per core). On a shared machine use fewer threads "
        "than free cores: a thread that waits for a busy core stalls every forward.",
        low=0,
        problem="--threads must be >= 0 (0 is torch's default)",
        panel=DECODING_PANEL,
    ),
    Option(
        "thinking_markers",
        "<think>,</think>",
        "The two tokens that open and close a reasoning model's thinking, comma-separated: each answer's thinking "
        "and the rest get acceptance, tau and tokens/s of their own (thinking_* and answer_* columns, and a "
        "table). Each must be one token of the target's vocabulary; the default splits only where it is. Empty: "
        "no split.",
        check=lambda text: text == "" or len([part for part in text.split(",") if part.strip()]) == 2,
        problem="--thinking-markers takes two tokens, OPEN,CLOSE (e.g. '<think>,</think>'), or '' for no split",
        metavar="OPEN,CLOSE",
        read_by=(RUN_COMMAND,),
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "chat",
        "auto",
        "auto: wrap prompts in the target's chat template when it has one (instruct models); on; off (raw prompts).",
        choices=("auto", "on", "off"),
        panel=DECODING_PANEL,
    ),
    Option(
        "random_weights",
        False,
        "Build target and draft from their architecture (configs/ for the aliases, or a config.json) with random "
        "weights: forward costs and tokens/s without the checkpoints; alpha is left empty (see --assume-alpha) "
        "unless --synthetic-acceptance sets it.",
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "prompt_tokens",
        0,
        "With --random-weights: random prompts of this many tokens (0: the dataset's lengths).",
        low=0,
        problem="--prompt-tokens must be >= 0 (0: the dataset's prompt lengths)",
        read_by=(RANDOM_WEIGHTS,),
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "assume_alpha",
        [],
        "Comma-separated alphas: predicted.csv and a table of the speedup each would give at each K, from the "
        "measured forward costs (default 0.5,0.6,0.7,0.8 with --random-weights).",
        parse=float_list,
        kind=float,
        check=lambda alphas: all(0 <= a < 1 for a in alphas),
        problem="--assume-alpha values must lie in [0, 1)",
        read_by=(TORCH, RUN_COMMAND),
        panel=TIMING_PANEL,
    ),
    Option(
        "device_map",
        None,
        "Spread the target over the GPUs with accelerate: auto, balanced, balanced_low_0 or sequential "
        "(empty: all on --device). The map goes into meta.json.",
        choices=("auto", "balanced", "balanced_low_0", "sequential"),
        read_by=(TORCH,),
        panel=DECODING_PANEL,
    ),
    Option(
        "context_tokens",
        0,
        "--dataset longcode: prompt length in tokens (source cut to end inside a function). A comma-separated "
        "list runs once per length into OUT/context-N/ and writes context.csv, crossover.json and context.png.",
        parse=int_list,
        low=0,
        read_by=(LONG,),
        panel=WORKLOAD_PANEL,
    ),
    Option(
        "compile",
        None,
        "specbench's own forward for Llama, Mistral, Qwen2 and Qwen3 models (docs/methodology.md#the-fast-path): on a CPU the "
        "weights packed once for oneDNN's kernels (models from 256 wide), each row count run on the packed or the model's own "
        "weights, as measured fastest at load; on CUDA "
        "torch.compile. --no-compile runs transformers' eager forward (and turns CUDA's --graphs default off). Default: "
        "on for a CPU; on CUDA --graphs runs instead. The hf-* methods always run transformers'.",
        kind=bool,
        read_by=(TORCH,),
        panel=DECODING_PANEL,
    ),
    Option(
        "graphs",
        None,
        "The static path for Llama, Mistral, Qwen2 and Qwen3 models (docs/methodology.md#the-static-path): the KV cache allocated "
        "once for the run's longest sequence, forwards compiled per shape with torch.compile and, on CUDA, replayed "
        "as CUDA graphs; a rejected draft only moves a position. Default: on with CUDA, off on a CPU, where the "
        "packed forward measured faster; it compiles, so it does not take --no-compile. --no-graphs runs the forward "
        "--compile chooses.",
        kind=bool,
        read_by=(TORCH,),
        panel=DECODING_PANEL,
    ),
    Option(
        "prefill_chunk",
        512,
        "Prefill prompts longer than this in chunks of it, so memory stays bounded (0: one forward).",
        low=0,
        problem="--prefill-chunk must be >= 0 (0: the whole prompt in one forward)",
        read_by=(TORCH, RUN_COMMAND),
        panel=DECODING_PANEL,
    ),
)

# The engines and what only a serving engine (vLLM) takes: many requests, models over many devices.
ENGINE_PANEL = "Engines: vLLM, many requests, many devices (docs/engines.md)"
ENGINE: tuple[Option, ...] = (
    Option(
        "engines",
        ["torch"],
        "Who decodes: torch (specbench's loop, with transformers' hf-* methods) and/or vllm, comma-separated, or "
        "server (running servers: --baseline-url, --server), or llama-cpp (llama.cpp's llama-server, started by "
        "specbench); each engine's methods are timed against its own baseline.",
        flags=("--engine",),
        parse=name_list,
        choices=("torch", "vllm", "server", "llama-cpp"),
        metavar="[torch|vllm|torch,vllm|server|llama-cpp]",
        panel=ENGINE_PANEL,
    ),
    Option(
        "concurrency",
        [1],
        "Requests in flight (vLLM, servers), a comma-separated list sweeps, e.g. 1,4,16; needs as many prompts.",
        parse=int_list,
        low=1,
        problem="--concurrency must be at least 1 (requests in flight)",
        read_by=(RUN_COMMAND,),
        panel=ENGINE_PANEL,
    ),
    Option(
        "tensor_parallel_size",
        1,
        "vLLM: devices that split each layer; on a CPU, workers that specbench binds to cores of their own "
        "(unless VLLM_CPU_OMP_THREADS_BIND is set).",
        low=1,
        read_by=(VLLM,),
        panel=ENGINE_PANEL,
    ),
    Option(
        "pipeline_parallel_size",
        1,
        "vLLM: devices (or machines) that split the layers; on a CPU, not with speculation.",
        low=1,
        read_by=(VLLM,),
        panel=ENGINE_PANEL,
    ),
    Option(
        "distributed_executor_backend",
        None,
        "vLLM's workers: mp (processes on this machine) or ray (a Ray cluster, for many machines); empty: vLLM's choice.",
        choices=("mp", "ray"),
        read_by=(VLLM,),
        panel=ENGINE_PANEL,
    ),
    Option(
        "engine_args",
        {},
        "Any other vLLM engine argument as a JSON object, e.g. '{\"enforce_eager\": true}'; recorded in meta.json.",
        parse=json_object,
        metavar="JSON",
        read_by=(VLLM,),
        panel=ENGINE_PANEL,
    ),
)


def entries_given(given: list[str]) -> list[str]:
    """A repeatable flag of NAME=VALUE entries, in order (a URL may hold commas: no splitting)."""
    return [value.strip() for value in given if value.strip()]


SERVER_PANEL = "Servers: benchmark running servers over their OpenAI API (docs/servers.md)"
SERVER: tuple[Option, ...] = (
    Option(
        "baseline_url",
        None,
        "--engine server: the API URL of a server running the target alone, e.g. http://127.0.0.1:8000/v1 "
        "(every server's speedup is over it).",
        metavar="URL",
        read_by=(SERVER_ENGINE,),
        panel=SERVER_PANEL,
    ),
    Option(
        "servers",
        [],
        "--engine server: a speculating server, NAME=URL (repeatable); NAME is its rows' method.",
        flags=("--server",),
        repeat=entries_given,
        metavar="NAME=URL",
        read_by=(SERVER_ENGINE,),
        panel=SERVER_PANEL,
    ),
    Option(
        "launch",
        [],
        "--engine server: start a server for the run, NAME=COMMAND with {port} where its port goes (repeatable); "
        "NAME baseline is the baseline, draft the draft alone, any other a speculating server. A command with {k} "
        "starts a server for each --k in turn, with the K in its command ({draft}: where --draft is). Each runs on "
        "127.0.0.1 only for its own requests, logged to OUT/servers/NAME.log (NAME-kK.log for each K).",
        repeat=entries_given,
        metavar="NAME=COMMAND",
        read_by=(SERVER_ENGINE,),
        panel=SERVER_PANEL,
    ),
    Option(
        "draft_url",
        None,
        "--engine server: a server running the draft model alone, for c (its one-token decode time over the baseline's).",
        metavar="URL",
        read_by=(SERVER_ENGINE,),
        panel=SERVER_PANEL,
    ),
    Option(
        "request_rate",
        [float("inf")],
        "Requests sent per second, Poisson arrivals seeded by --seed, a comma-separated list sweeps; inf sends "
        "all at once, held to --concurrency (as vllm bench serve's --request-rate and --max-concurrency).",
        parse=float_list,
        infinite=True,
        check=lambda rates: all(rate > 0 for rate in rates),
        problem="--request-rate must be above 0 requests per second (inf: all at once)",
        read_by=(RUN_COMMAND,),
        panel=SERVER_PANEL,
    ),
    Option(
        "api",
        "completions",
        "--engine server: completions (the prompt as token ids, rendered here: every server gets the same ids) "
        "or chat (messages; each server renders them with its own template).",
        choices=("completions", "chat"),
        read_by=(SERVER_ENGINE, LLAMA_CPP),
        panel=SERVER_PANEL,
    ),
    Option(
        "api_key_env",
        "OPENAI_API_KEY",
        "--engine server: the environment variable that holds the servers' API key (sent as a bearer token, "
        "never written anywhere).",
        metavar="NAME",
        read_by=(SERVER_ENGINE,),
        panel=SERVER_PANEL,
    ),
    Option(
        "request_timeout",
        600.0,
        "--engine server: seconds a request may take before it is recorded as failed.",
        low=1.0,
        read_by=(SERVER_ENGINE, LLAMA_CPP),
        panel=SERVER_PANEL,
    ),
)

LLAMA_PANEL = "llama.cpp: --engine llama-cpp starts llama-server for each method and K (docs/engines.md)"
LLAMA: tuple[Option, ...] = (
    Option(
        "llama_server",
        None,
        "--engine llama-cpp: the llama-server binary (default: $LLAMA_CPP_DIR/bin, .llama-cpp/bin, then PATH; "
        "`make install-llama-cpp` builds it).",
        metavar="PATH",
        read_by=(LLAMA_CPP,),
        panel=LLAMA_PANEL,
    ),
    Option(
        "gguf_type",
        "auto",
        "--engine llama-cpp: the precision of the GGUF files made from the models (once, cached): auto keeps a .gguf "
        "target as it is and converts checkpoints to f32 (specbench's loop on a CPU); f32, f16, bf16 or q8_0 converts "
        "every model, a .gguf target from the float32 copy specbench's loop decodes.",
        choices=("auto", "f32", "f16", "bf16", "q8_0"),
        read_by=(LLAMA_CPP,),
        panel=LLAMA_PANEL,
    ),
    Option(
        "draft_sampling",
        ["greedy", "probabilistic"],
        "--engine llama-cpp: how the draft method's tokens are drawn (llama-server --spec-draft-sampling), a row "
        "each: greedy (the draft's argmax, kept while the target's own sample matches it) and/or probabilistic "
        "(sampled, verified by rejection sampling).",
        parse=name_list,
        choices=("greedy", "probabilistic"),
        read_by=(LLAMA_CPP,),
        panel=LLAMA_PANEL,
    ),
    Option(
        "llama_threads",
        0,
        "--engine llama-cpp: CPU threads of each llama-server (0: llama.cpp's default, the physical cores).",
        low=0,
        read_by=(LLAMA_CPP,),
        panel=LLAMA_PANEL,
    ),
)


def each_given(given: list[str]) -> list[str]:
    """A repeatable flag whose values hold commas themselves (--setting temperature=0.7,top_p=0.9)."""
    return list(dict.fromkeys(value.strip() for value in given if value.strip()))


AUDIT_PANEL = "Audit: the sampling settings, sample sizes and levels of `specbench audit` (docs/audit.md)"
# `specbench audit`'s own options, beside the run's (which choose the models, engines and methods).
AUDIT: tuple[Option, ...] = (
    Option(
        "settings",
        ["greedy", "temperature=1", "temperature=0.7,top_p=0.9", "temperature=0.8,top_k=20,repetition_penalty=1.2"],
        "A sampling setting to audit (repeatable): greedy, or KEY=VALUE,... of temperature, top_k, top_p, min_p, "
        "repetition_penalty, presence_penalty, frequency_penalty.",
        flags=("--setting",),
        repeat=each_given,
        metavar="SETTING",
        panel=AUDIT_PANEL,
    ),
    Option(
        "samples",
        1000,
        "Samples per arm, prompt and sampling setting (the reference, its control and each subject).",
        low=50,
        panel=AUDIT_PANEL,
    ),
    Option(
        "length",
        0,
        "Tokens of each sample, whose law is tested (0: K + 2, so that rejections, resampling and bonus tokens occur).",
        low=0,
        panel=AUDIT_PANEL,
    ),
    Option(
        "prompts",
        3,
        "Prompts per setting: the sampling tests take those of the --num-prompts candidates whose pilot sample "
        "is most moderately varied; greedy takes the first.",
        low=1,
        panel=AUDIT_PANEL,
    ),
    Option(
        "greedy_tokens",
        [128, 512],
        "Greedy answers are compared up to each of these lengths (the longest is decoded). Not given, each "
        "default is capped at half of the context window that a round's forward leaves, so prompts keep the rest.",
        parse=int_list,
        low=1,
        panel=AUDIT_PANEL,
    ),
    Option(
        "level",
        0.01,
        "Family-wise error rate of the sampling tests (Holm's correction over subjects, settings and prompts).",
        check=lambda level: 0 < level < 1,
        problem="--level must be in (0, 1), e.g. 0.01",
        panel=AUDIT_PANEL,
    ),
    Option(
        "power_tv",
        0.25,
        "The total-variation distance every sampling test must detect with 80% power; a --samples too small to "
        "promise it is refused, and a pass whose test cannot is shown as underpowered.",
        check=lambda tv: 0 < tv <= 1,
        problem="--power-tv must be in (0, 1]",
        panel=AUDIT_PANEL,
    ),
    Option(
        "broken",
        [],
        "A known-broken subject to add (repeatable, or all): a bug an engine shipped, rebuilt in specbench's loop "
        "to show the audit catches it (`specbench list` names them).",
        repeat=names_given,
        metavar="NAME",
        panel=AUDIT_PANEL,
    ),
)
