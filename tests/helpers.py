"""Plain helpers the test modules share: the CLI in a subprocess, tiny local models, timing data.

A test module imports from here (or from toy.py), never from another test module, so each can be
run, moved or deleted alone.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print('hello ' + name)\n",
    "for i in range(10):\n    total += i * i\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


# ---------------------------------------------------------------- the CLI


def specbench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specbench", *args], capture_output=True, text=True, timeout=timeout)


def on_tiny_pair(command: str, tiny_pair, *args, timeout=300):
    """``specbench COMMAND`` with the tiny target and draft."""
    return specbench(command, "--target", tiny_pair[0], "--draft", tiny_pair[1], *args, timeout=timeout)


def one_line_error(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------- tiny models built locally (no hub)


def build_tokenizer(path: Path, vocab_size: int = 320, seed_text: list[str] = CORPUS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(seed_text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(path)
    return fast


def build_llama(
    path: Path, tokenizer, layers: int, hidden: int, seed: int, vocab_pad: int = 0, window: int = 256, tie: bool = True
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
    # Larger logits than the default init, so greedy ties are unlikely and sampling is not uniform.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
        if not tie:
            model.get_output_embeddings().weight.mul_(20)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
