"""Tiny random models of each family that specbench's own forward covers (models/fast.FAMILIES), built
in memory with confident rows, so that greedy near-ties are rare and a forward that drops a part of the
arithmetic (a bias, a norm) moves the scores far."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


def built(causal_lm, config_class, seed: int, layers: int, hidden: int, vocab: int, scale: float, **shape):
    """A random ``causal_lm`` of the tests' common shape (grouped heads, 4 over 2) and ``shape``'s own
    fields, its embeddings scaled by ``scale`` for confident rows."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **shape,
    )  # fmt: skip
    model = causal_lm(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    return model


def llama(seed: int, layers: int = 2, hidden: int = 64, vocab: int = 300):
    return built(LlamaForCausalLM, LlamaConfig, seed, layers, hidden, vocab, 20)  # near-ties rare


def qwen3(seed: int, layers: int = 2, hidden: int = 64, vocab: int = 300):
    """Qwen3's shape: grouped heads with head_dim set apart from the width, per-head query and key norms."""
    # Tied, this small random Qwen3 repeats one token whatever it reads.
    model = built(Qwen3ForCausalLM, Qwen3Config, seed, layers, hidden, vocab, 4, head_dim=32, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in model.model.layers:  # norms of ones would hide a norm applied to the wrong half
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return model


def qwen2(seed: int, layers: int = 2, hidden: int = 64, vocab: int = 300):
    """Qwen2's shape: Llama's with biases on the query, key and value products."""
    model = built(Qwen2ForCausalLM, Qwen2Config, seed, layers, hidden, vocab, 20, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in model.model.layers:  # transformers initialises biases to zeros, which a forward could drop
            for product in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                product.bias.normal_(0.0, 0.5)
    return model


def mistral(seed: int, layers: int = 2, hidden: int = 64, vocab: int = 300):
    """Mistral's shape without its sliding window (Mistral 7B v0.2 on): Llama's decoder."""
    return built(MistralForCausalLM, MistralConfig, seed, layers, hidden, vocab, 20, sliding_window=None)


# Each family once, for tests parametrised over them.
FAMILIES = [pytest.param(f, id=f.__name__) for f in (llama, mistral, qwen2, qwen3)]
