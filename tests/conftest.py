"""Tiny models built locally (no hub): a byte-level BPE tokenizer and random Llama pairs."""

import json
from pathlib import Path

import pytest
import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print('hello ' + name)\n",
    "for i in range(10):\n    total += i * i\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the exactness tests decode tiny tensors thousands of times,
    where intra-op threads only add wake-up latency (10x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """(target dir, draft dir): a 4-layer and a 1-layer random Llama sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer(root / "tok")
    target = build_llama(root / "target", tokenizer, layers=4, hidden=64, seed=0)
    draft = build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=1)
    return str(target), str(draft)


@pytest.fixture(scope="session")
def untied_target(tiny_pair, tmp_path_factory) -> str:
    """A target for tiny_pair's draft that the draft mostly mispredicts under greedy. A random model
    with tied embeddings repeats its last token, as the tiny draft does; an untied one writes varied
    text, so a draft has something to learn from it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    return str(
        build_llama(tmp_path_factory.mktemp("untied") / "target", tokenizer, layers=4, hidden=64, seed=0, tie=False)
    )


@pytest.fixture(scope="session")
def padded_draft(tiny_pair, tmp_path_factory) -> str:
    """A draft for tiny_pair's target whose embedding matrix is padded 16 rows wider, as model
    families with one tokenizer often are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    return str(
        build_llama(tmp_path_factory.mktemp("padded") / "draft", tokenizer, layers=1, hidden=32, seed=1, vocab_pad=16)
    )


@pytest.fixture(scope="session")
def foreign_draft(tmp_path_factory) -> str:
    """A draft whose tokenizer has the same size as tiny_pair's but different contents."""
    root = tmp_path_factory.mktemp("foreign")
    tokenizer = build_tokenizer(root / "tok", seed_text=["SELECT * FROM t WHERE x = 1;\n"] * 50 + CORPUS[:4])
    return str(build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=2))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = ["def square(x):\n", "class Stack:\n    def push(self, item):\n", "for k in range(3):\n"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    return str(path)
