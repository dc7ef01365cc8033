"""Plain helpers the test modules share: the CLI in a subprocess or in this process, tiny local models,
timing data.

A test module imports from here (or from toy.py), never from another test module, so each can be
run, moved or deleted alone.
"""

import io
import json
import math
import subprocess
import sys
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print('hello ' + name)\n",
    "for i in range(10):\n    total += i * i\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


# ---------------------------------------------------------------- processes


def processes():
    """(pid, parent pid, argv, environment) of each process readable in /proc, argv and environment
    as the kernel keeps them (lists of bytes): the servers a test started are found among them."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("PPid:"))
            argv = (status.parent / "cmdline").read_bytes().split(b"\0")
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):
            continue
        yield int(status.parent.name), ppid, argv, environ


# ---------------------------------------------------------------- the CLI


def specbench(*args, timeout=300):
    """``specbench ARGS`` end to end, in a new interpreter."""
    return subprocess.run([sys.executable, "-m", "specbench", *args], capture_output=True, text=True, timeout=timeout)


def cli(*args) -> subprocess.CompletedProcess:
    """``specbench ARGS`` in this process, as its entry point runs it (one-line errors, exit codes), with
    its output captured: for what the CLI refuses, without the seconds a new interpreter spends
    importing torch and transformers. The thread count a command sets is put back."""
    from specbench.cli.app import main

    out, err, argv, threads, code = io.StringIO(), io.StringIO(), sys.argv, torch.get_num_threads(), 0
    sys.argv = ["specbench", *map(str, args)]
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["specbench", *args], code, out.getvalue(), err.getvalue())


def cli_on_tiny_pair(command: str, tiny_pair, *args):
    """cli(): ``specbench COMMAND`` with the tiny target and draft, in this process."""
    return cli(command, "--target", tiny_pair[0], "--draft", tiny_pair[1], *args)


def one_line_error(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------- tiny models built locally (no hub)


def build_tokenizer(path: Path, vocab_size: int = 320, seed_text: list[str] = CORPUS, special: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>", *special], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(seed_text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(path)
    return fast


def write_sources(tmp_path: Path) -> Path:
    """A directory of Python source for distill's --source: two documented functions, repeated."""
    sources = tmp_path / "src"
    sources.mkdir(exist_ok=True)
    (sources / "lib.py").write_text(
        (
            'def add_up(a: int, b: int) -> int:\n    """Add two numbers and return their sum, whatever their type."""\n    return a + b\n\n\n'
            'def greet(name):\n    """Say hello to someone by name, on standard output, then return."""\n    print("hello " + name)\n\n\n'
        )
        * 6
    )
    return sources


def build_llama(
    path: Path,
    tokenizer,
    layers: int,
    hidden: int,
    seed: int,
    vocab_pad: int = 0,
    window: int = 256,
    tie: bool = True,
    scale: float = 20.0,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + vocab_pad,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config)
    # Larger logits than the default init (``scale`` 1), so greedy ties are unlikely and sampling is not uniform.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
        if not tie:
            model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


THINKING_PROMPTS = [
    "def square(x):\n<think>",
    "class Stack:\n    def push(self, item):\n<think>",
    "for k in range(3):\n<think>",
]


def build_thinking_pair(root: Path, hidden: int = 128) -> tuple[str, str, str]:
    """(target dir, draft dir, prompts file) of a pair that thinks: its vocabulary holds <think> and
    </think>, each prompt ends in <think>, and the target closes its thinking part-way through an
    answer: its output row of </think> is a little more than the row of the token its greedy answers
    repeat most, so </think> comes where that token would have. The draft is the target with noise
    (it agrees with it often, not always). Heads of 32 (``hidden`` 128), the least vLLM's CPU
    attention takes."""
    from collections import Counter

    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(root / "tok", special=("<think>", "</think>"))
    build_llama(root / "target", tokenizer, layers=2, hidden=hidden, seed=0, tie=False)
    model = AutoModelForCausalLM.from_pretrained(root / "target")
    seen = Counter()
    noise = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for prompt in THINKING_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            seen.update(model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist())
        close = tokenizer.convert_tokens_to_ids("</think>")
        model.lm_head.weight[close] = model.lm_head.weight[seen.most_common(1)[0][0]] * 1.1
        model.save_pretrained(root / "target")
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.3 * param.std())
    model.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": prompt} for prompt in THINKING_PROMPTS])
    return str(root / "target"), str(root / "draft"), str(prompts)


def check_thinking_split(out: Path, counted: set[tuple[str, str]]):
    """A run's thinking split (core/thinking.py), as its own files tell it: each record's span tokens
    are its outputs' labels under the markers meta.json names (every prompt ends in <think>), its
    seconds add up to its time (specbench's loop) or within it (served: from the start to the last
    id), and for the (engine, method) rows in ``counted`` its spans' forwards, drafts and acceptances
    add up to its totals. Returns records.csv."""
    import pandas as pd

    from specbench.core.thinking import Markers

    records = pd.read_csv(out / "records.csv")
    outputs = {
        (o["engine"], o["prompt_index"], o["method"], o["k"]): o["token_ids"]
        for o in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())
    }
    markers = Markers(*json.loads((out / "meta.json").read_text())["resolved"]["thinking_markers"])
    for row in records.to_dict("records"):
        k = None if row["k"] != row["k"] else int(row["k"])
        labels = markers.labels(outputs[(row["engine"], row["prompt_index"], row["method"], k)], inside=True)
        assert (row["thinking_tokens"], row["answer_tokens"]) == (sum(labels), len(labels) - sum(labels)), row
        names = ("forwards", "drafted", "accepted") if (row["engine"], row["method"]) in counted else ("forwards",)
        for name in names:  # a baseline reports no drafts: a token a forward
            total = row["target_forwards" if name == "forwards" else name]
            assert row[f"thinking_{name}"] + row[f"answer_{name}"] == total, (name, row)
        seconds = row["thinking_s"] + row["answer_s"]
        if row["engine"] == "torch":
            assert seconds == pytest.approx(row["method_s"], rel=1e-9)
        else:
            assert 0 < seconds <= row["method_s"]
    return records


def build_audit_pair(root: Path, hidden: int = 64, offset: float = 1000.0) -> tuple[str, str]:
    """(target dir, draft dir) for the audit's tests: a target of moderate entropy (its samples of a few
    tokens repeat, so a test of their law has power) and a draft that is a noisy, flatter copy of it
    (accepted about a third of the time), whose every logit at a position carries one common offset
    of about ``offset`` (its law is unchanged, but its logits are as large as a big model's, so that
    rounding them to bfloat16 moves its law, as the draft-bf16 bug needs)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(root / "tok")
    build_llama(root / "target", tokenizer, layers=2, hidden=hidden, seed=0, tie=False)
    model = AutoModelForCausalLM.from_pretrained(root / "target")
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
        model.save_pretrained(root / "target")
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.5 * param.std())
        model.lm_head.weight.mul_(0.5)
        # The offset: each logit gains offset * (u . h), u the mean direction of the final hidden states.
        ids = tokenizer("".join(CORPUS[:4]), return_tensors="pt").input_ids
        states = model(ids, output_hidden_states=True).hidden_states[-1][0]
        model.lm_head.weight.add_(offset * states.mean(0) / states.mean(0).norm())
    model.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def audit_workload(root: Path, hidden: int = 64) -> tuple[str, str, str]:
    """build_audit_pair's target and draft, and a prompt file (prompts.jsonl) of texts the target
    continues with tokens it has already seen (its own greedy continuations), so that a repetition
    penalty changes its law. The audit's tests and `make ci-audit` run on these."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(root)
    target, draft = build_audit_pair(root, hidden=hidden)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(target), AutoTokenizer.from_pretrained(target)
    rows = []
    for text in ["def square(x):\n", "class Stack:\n", "for k in range(3):\n", "def add(a, b):\n"]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        rows.append({"prompt": tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0])})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return target, draft, str(prompts)


class LawLM(HFCausalLM):
    """A tiny Llama of VOCAB tokens on the fast forward, whose exact law transformers computes: the
    logits after a context are its eager forward over the whole context, without a cache."""

    def __init__(self, model, packed: bool):
        # Every row count as it comes (plan={}): packed means the packed kernel, whatever a plan would
        # measure on so small a model (its own weights, on some CPUs).
        super().__init__(model, model.config.vocab_size, fast=FastLlama(model, packed=packed, plan={}))
        self.vocab = model.config.vocab_size

    @torch.inference_mode()
    def logits_after(self, context: list[int]) -> torch.Tensor:
        """On the CPU, in float32, whatever the model's device: the exact law is enumerated there."""
        return self.model(input_ids=torch.tensor([context], device=self.device)).logits[0, -1].float().cpu()


def cache_with_default_target(cache: Path) -> Path:
    """``cache``, a SPECBENCH_CACHE of a test's own, with a link to the default target's float32 copy in
    the user's cache (made there first where it is missing, as test_smollm2's tests make it). Tests that
    run the default target under a cache of their own dequantised its GGUF again, about 30 s each; that
    conversion has tests of its own (test_smollm2)."""
    from specbench.core.environment import cache_dir
    from specbench.models.load import local_dir
    from specbench.models.names import resolve

    # Called before the test sets SPECBENCH_CACHE to ``cache``: the copy is then the user's.
    assert not cache_dir().is_relative_to(cache), "call it before SPECBENCH_CACHE names the test's cache"
    copy = local_dir(resolve("smollm2-135m"))
    link = cache / copy.relative_to(cache_dir())
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(copy, target_is_directory=True)
    return cache


def tiny_law_model(seed: int, tmp_path, device: str = "cpu"):
    """A 2-layer Llama of 3 tokens, built and loaded on the CPU, then moved to ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8)  # a law far from uniform, so a wrong cache shows
    model.save_pretrained(tmp_path / f"law{seed}")
    return AutoModelForCausalLM.from_pretrained(tmp_path / f"law{seed}").to(device).eval()


def build_eagle3_head(
    path: Path, target_config, taps=None, draft_ids=None, seed: int = 0, scale: float = 3.0, layer_prefix="midlayer"
) -> Path:
    """An EAGLE-3 head of random weights for a target of ``target_config``, written as vLLM's and
    SGLang's loaders read one: config.json (LlamaForCausalLMEagle3, draft_vocab_size and the aux layer
    ids in eagle_config) and model.safetensors (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``
    = target id - draft id, ``t2d`` = which target ids are drafted). ``taps`` None writes no layer ids
    (the loader's default: 2, L/2, L-3); () writes an EAGLE-1-style head (no fc, final states)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, heads = target_config.hidden_size, target_config.num_attention_heads
    kv, d = target_config.num_key_value_heads, target_config.hidden_size // heads
    vocab, inner = target_config.vocab_size, 2 * h
    draft_ids = torch.arange(vocab) if draft_ids is None else torch.tensor(draft_ids)

    def w(out, into):
        return torch.randn(out, into, generator=g) * scale / math.sqrt(into)

    fused = taps != ()
    tensors = {
        f"{layer_prefix}.input_layernorm.weight": torch.ones(h),
        f"{layer_prefix}.hidden_norm.weight": torch.ones(h),
        f"{layer_prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{layer_prefix}.self_attn.q_proj.weight": w(heads * d, 2 * h),
        f"{layer_prefix}.self_attn.k_proj.weight": w(kv * d, 2 * h),
        f"{layer_prefix}.self_attn.v_proj.weight": w(kv * d, 2 * h),
        f"{layer_prefix}.self_attn.o_proj.weight": w(h, heads * d),
        f"{layer_prefix}.mlp.gate_proj.weight": w(inner, h),
        f"{layer_prefix}.mlp.up_proj.weight": w(inner, h),
        f"{layer_prefix}.mlp.down_proj.weight": w(h, inner),
        "norm.weight": torch.ones(h),
        "lm_head.weight": w(len(draft_ids), h),
    }
    if len(draft_ids) < vocab:  # a full vocabulary has no mapping: vLLM refuses a d2t then
        tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, draft_ids, True)
    if fused:
        tensors["fc.weight"] = w(h, 3 * h)
    eagle = {"use_aux_hidden_state": fused}
    if fused and taps is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = list(taps)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inner,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": len(draft_ids),
        "eagle_config": eagle,
        "torch_dtype": "float32",
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- host reads


# What makes the host wait for the device: reading values, converting a tensor to a Python number
# or truth value, indexing a list with it, and multinomial (it reads its input's sum).
READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "multinomial", "nonzero"}


# Tensors made from host data straight onto a device: on CUDA, a copy from pageable memory that waits
# for the work queued before it (specbench.decoding.transfer.to_device makes them without a wait).
MADE_ON_DEVICE = {"tensor", "as_tensor", "asarray"}
# Indexing with a Python list makes the index such a tensor, on the indexed tensor's device.
INDEXED = {"__getitem__", "__setitem__"}


def host_index(index) -> bool:
    """Whether ``index`` (of a tensor's [] or []=) makes the host wait: a non-empty Python list (torch
    makes it a tensor on the indexed tensor's device, on CUDA a copy from pageable memory that waits),
    or a boolean mask (the positions it selects are counted on the device and read, as nonzero reads)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(
        (isinstance(part, list) and part) or (isinstance(part, torch.Tensor) and part.dtype == torch.bool)
        for part in parts
    )


class Dispatched(TorchDispatchMode):
    """Counts the aten operations dispatched inside it (views included), by name: on CUDA each but a
    view is a kernel launch (tests/models/test_static.py, benchmarks/graph_host_cost.py)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """Counts the torch calls inside it that make the host wait for the device (test_syncs, make
    gpu-check): reads of a tensor, tensors made from host data with a ``device=`` (MADE_ON_DEVICE), and
    tensors indexed with a Python list (INDEXED).

    With ``device``, only calls on that device count: inductor's CUDA wrapper reads the 0-d CPU
    tensors that dynamo passes its float arguments in (eps) with .item() at every call, and those wait
    on nothing (on an H200, CUDA's own sync count was the same with and without them)."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # A compiled region reads nothing from the host, and a count that torch.compile traced would
        # become a guard: every decode would recompile the fast forward's functions (seen on CUDA).
        name, result = getattr(func, "__name__", ""), func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling():
            return result
        if name in READS:
            read = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.count += self.device is None or read is None or read.device.type == self.device
        elif name in MADE_ON_DEVICE and (kwargs or {}).get("device") is not None and result.numel():
            # Host data only (a tensor already there is no copy); an empty one copies nothing either
            # (transformers' cache makes its layers so).
            if not (args and isinstance(args[0], torch.Tensor)):
                self.count += self.device is None or result.device.type == self.device
        elif name in INDEXED and len(args) > 1 and host_index(args[1]):
            self.count += self.device is None or args[0].device.type == self.device
        return result


# ---------------------------------------------------------------- timings


def noisy_prompts(rng, noise, prompts=8, slowdown=1.0):
    """Per-prompt (new_tokens, method_s, baseline_tokens, baseline_s) for two runs of the same prompts:
    speedup differs by prompt, each time is off by up to ``noise`` either way, and the current run's
    method takes ``slowdown`` times as long."""
    tokens = rng.integers(24, 65, prompts).astype(float)
    base_s = tokens / 25 * rng.uniform(0.8, 1.2, prompts)
    method_s = base_s / rng.uniform(1.1, 1.6, prompts)

    def run(slow):
        jitter = rng.uniform(1 - noise, 1 + noise, (2, prompts))
        return np.column_stack([tokens, method_s * slow * jitter[0], tokens, base_s * jitter[1]])

    return run(1.0), run(slowdown)


# ---------------------------------------------------------------- workload files


MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def spec_bench_rows():
    """Spec-Bench's shape: MT-Bench's two-turn questions first (ids from 81), then one-turn ones."""
    rows = [
        {"question_id": 81 + i, "category": c, "turns": [f"def {c}_{i}(a, b):", f"now call {c} with i = {i}"]}
        for i, c in enumerate(MT_BENCH[:3] * 2)
    ]
    rows += [{"question_id": 161 + i, "category": "translation", "turns": [f"print('hola {i}')"]} for i in range(3)]
    rows += [{"question_id": 241, "category": "summarization", "turns": ["Summarize: for k in range(3): total += k"]}]
    rows[0]["reference"] = ["not a turn"]
    return rows


def distill_run(path: Path, prompts: list[list[int]], target: str = "t") -> Path:
    """A distill output directory of one greedy shard, an answer of two tokens to each prompt, with
    features (4 per position) stored beside it."""
    (path / "generated").mkdir(parents=True)
    (path / "features" / "generated").mkdir(parents=True)
    (path / "distill.json").write_text(json.dumps({"target": target, "sampled_fraction": 0.25}))
    docs = [
        {
            "ids": torch.tensor(prompt + [7, 8]).int(),
            "prompt_len": len(prompt),
            "top_logp": torch.zeros(2, 1),
            "top_idx": torch.zeros(2, 1, dtype=torch.int),
            "source": "sharegpt",
        }
        for prompt in prompts
    ]
    torch.save(docs, path / "generated" / "0000.pt")
    torch.save([torch.zeros(len(d["ids"]), 4) for d in docs], path / "features" / "generated" / "0000.pt")
    return path
