"""Tree forward and path compaction of the KV cache: one pass over a tree of drafts must score
every node as a linear decode of its own branch would, and keeping an accepted path must leave
the cache as if only that path had been decoded."""

import pytest
import torch

from specbench.decoding.tree import tree_inputs
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM
from specbench.models.load import load
from tests.toy import ToyLM

CPU, F32 = torch.device("cpu"), torch.float32
# Node 6's branch is nodes 1, 4, 6: not contiguous in the flattened order.
PARENTS = [-1, -1, 0, 0, 1, 2, 4]
ACCEPTED = [1, 4, 6]


def branch(parents, i):
    """Node i's ancestors and itself, root first."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def reference_inputs(parents, cache_len):
    """(positions, mask) built straight from the branches, as the oracle for tree_inputs."""
    n = len(parents)
    positions = torch.tensor([cache_len + len(branch(parents, i)) - 1 for i in range(n)])
    mask = torch.zeros(n, cache_len + n, dtype=torch.bool)
    mask[:, :cache_len] = True
    for i in range(n):
        mask[i, [cache_len + j for j in branch(parents, i)]] = True
    return positions, mask


# ---------------------------------------------------------------- tree_inputs


def test_tree_inputs_of_a_chain_are_consecutive_positions_and_the_causal_mask():
    positions, mask = tree_inputs([-1, 0, 1, 2], 3, CPU)
    assert positions.dtype == torch.long and positions.tolist() == [3, 4, 5, 6]
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.ones(4, 7, dtype=torch.bool).tril(3))


@pytest.mark.parametrize("parents", [PARENTS, [-1, -1, -1], [-1, 0, 0, 1, 1, 2, 2], [-1]])
@pytest.mark.parametrize("cache_len", [0, 5])
def test_tree_inputs_let_each_node_see_the_cache_its_ancestors_and_itself(parents, cache_len):
    positions, mask = tree_inputs(parents, cache_len, CPU)
    want_positions, want_mask = reference_inputs(parents, cache_len)
    assert torch.equal(positions, want_positions)
    assert torch.equal(mask, want_mask)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2]])
def test_tree_inputs_refuse_a_parent_that_is_not_an_earlier_node(parents):
    with pytest.raises(ValueError):
        tree_inputs(parents, 2, CPU)


# ---------------------------------------------------------------- ToyLM


def test_toy_tree_forward_and_keep_match_linear_decoding():
    toy = ToyLM(vocab=6, seed=0)
    prefix, nodes = [1, 2, 3], [0, 4, 5, 1, 2, 3, 0]
    toy.forward(torch.tensor(prefix))
    positions, mask = tree_inputs(PARENTS, len(prefix), CPU)
    logits = toy.forward(torch.tensor(nodes), last=len(nodes), positions=positions, mask=mask)
    for i in range(len(nodes)):
        assert torch.equal(logits[i], toy.logits_after(prefix + [nodes[j] for j in branch(PARENTS, i)]))
    toy.keep(ACCEPTED, len(nodes))
    accepted = [nodes[j] for j in ACCEPTED]
    assert toy.seen == prefix + accepted
    assert torch.equal(toy.forward(torch.tensor([2]))[0], toy.logits_after(prefix + accepted + [2]))


def test_toy_keep_of_a_prefix_crops_and_of_nothing_drops_all_new():
    toy = ToyLM(vocab=6, seed=0)
    toy.forward(torch.tensor([1, 2, 3, 4, 5]))
    toy.keep(range(2), 3)
    assert toy.seen == [1, 2, 3, 4]
    toy.keep([], 2)
    assert toy.seen == [1, 2]
    toy.keep([], 0)
    assert toy.seen == [1, 2]


# ---------------------------------------------------------------- HFCausalLM


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def target_model(request, tiny_pair):
    if request.param == "sdpa":
        model = load(tiny_pair[0], CPU, F32).model
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], attn_implementation="eager").eval()
    assert model.config._attn_implementation == request.param
    return model


# transformers' forward (with sdpa or eager attention), and specbench's fast forward (models/fast.py) with
# the modules' weights and with oneDNN-packed ones: each must keep the engine's cache contract.
FORWARDS = ["transformers-sdpa", "transformers-eager", "fast-own", "fast-packed"]


@pytest.fixture(scope="module", params=FORWARDS)
def target_lm(request, tiny_pair):
    """A function (shortlisted) -> a fresh HFCausalLM of the tiny target, on the forward of the param."""
    if request.param == "transformers-eager":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], attn_implementation="eager").eval()
    else:
        model = load(tiny_pair[0], CPU, F32).model
    fast = (
        FastLlama(model, packed=request.param == "fast-packed", plan={}) if request.param.startswith("fast") else None
    )
    return lambda shortlisted: wrap(model, shortlisted, fast)


def wrap(model, shortlisted: bool, fast: FastLlama | None = None) -> HFCausalLM:
    width = model.get_output_embeddings().weight.shape[0]
    return HFCausalLM(model, width, torch.arange(0, width, 3) if shortlisted else None, fast)


def linear(lm: HFCausalLM, prefix: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after decoding prefix then tokens linearly from an empty cache."""
    lm.reset()
    lm.forward(prefix)
    return lm.forward(torch.tensor(tokens))[0]


def assert_same_scores(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal wherever the reference scores a token. A shortlisted head tried on the whole tree has
    read more ids than the linear decode of one branch, so it may score more, never fewer."""
    scored = torch.isfinite(want)
    assert scored.sum() > 0 and torch.isfinite(got[scored]).all()
    torch.testing.assert_close(got[scored], want[scored])


def tree_round(lm: HFCausalLM, prefix: torch.Tensor, nodes: list[int], parents: list[int]) -> torch.Tensor:
    lm.reset()
    lm.forward(prefix)
    positions, mask = tree_inputs(parents, len(prefix), lm.device)
    return lm.forward(torch.tensor(nodes), last=len(nodes), positions=positions, mask=mask)


def prompt_and_nodes(lm: HFCausalLM, n: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.width, (9 + n,), generator=g)
    return ids[:9], ids[9:].tolist()


@pytest.mark.parametrize("shortlisted", [False, True])
def test_tree_forward_scores_every_node_as_a_linear_decode_of_its_branch(target_lm, shortlisted):
    lm = target_lm(shortlisted)
    prefix, nodes = prompt_and_nodes(lm, len(PARENTS))
    logits = tree_round(lm, prefix, nodes, PARENTS)
    assert logits.shape == (len(nodes), lm.width)
    for i in range(len(nodes)):
        assert_same_scores(logits[i], linear(lm, prefix, [nodes[j] for j in branch(PARENTS, i)]))


@pytest.mark.parametrize("shortlisted", [False, True])
@pytest.mark.parametrize("accepted", [ACCEPTED, [0, 2, 5], [1]])
def test_keeping_an_accepted_path_leaves_the_cache_of_a_linear_decode(target_lm, shortlisted, accepted):
    lm = target_lm(shortlisted)
    prefix, nodes = prompt_and_nodes(lm, len(PARENTS) + 1)
    nodes, bonus = nodes[:-1], nodes[-1]
    tree_round(lm, prefix, nodes, PARENTS)
    lm.keep(accepted, len(nodes))
    assert lm.cache.get_seq_length() == len(prefix) + len(accepted)
    kept = len(prefix) + len(accepted)
    assert all(layer.keys.shape[-2] == layer.values.shape[-2] == kept for layer in lm.cache.layers)
    got = lm.forward(torch.tensor([bonus]))[0]
    # A second tree round on the compacted cache, positioned after the kept path.
    positions, mask = tree_inputs([-1, 0, -1], lm.cache.get_seq_length(), lm.device)
    second = lm.forward(torch.tensor(nodes[:3]), last=3, positions=positions, mask=mask)
    path = [nodes[j] for j in accepted]
    assert_same_scores(got, linear(lm, prefix, path + [bonus]))
    assert_same_scores(second[1], linear(lm, prefix, path + [bonus] + nodes[:2]))
    assert_same_scores(second[2], linear(lm, prefix, path + [bonus, nodes[2]]))


def test_keep_of_a_prefix_is_the_old_crop_and_of_nothing_drops_all_new(target_lm):
    lm = target_lm(False)
    prefix, chain = prompt_and_nodes(lm, 6)
    chain, bonus = chain[:5], chain[5]
    for kept in range(len(chain) + 1):
        lm.reset()
        lm.forward(prefix)
        lm.forward(torch.tensor(chain))
        lm.keep(range(kept), len(chain))
        assert lm.cache.get_seq_length() == len(prefix) + kept
        got = lm.forward(torch.tensor([bonus]))[0]
        torch.testing.assert_close(got, linear(lm, prefix, chain[:kept] + [bonus]))
    before = lm.cache.get_seq_length()
    lm.keep([], 0)  # nothing new: a no-op
    assert lm.cache.get_seq_length() == before


def test_a_chain_mask_gives_the_ordinary_forward(target_lm):
    lm = target_lm(False)
    prefix, nodes = prompt_and_nodes(lm, 4)
    lm.reset()
    lm.forward(prefix)
    _, mask = tree_inputs([-1, 0, 1, 2], len(prefix), CPU)
    masked = lm.forward(torch.tensor(nodes), last=4, mask=mask)  # positions default to consecutive
    lm.reset()
    lm.forward(prefix)
    torch.testing.assert_close(masked, lm.forward(torch.tensor(nodes), last=4))


def test_a_mask_of_the_wrong_shape_is_refused(target_lm):
    lm = target_lm(False)
    lm.reset()
    lm.forward(torch.tensor([1, 2, 3]))
    _, mask = tree_inputs([-1, 0], 2, CPU)
    with pytest.raises(ValueError, match="mask has shape"):
        lm.forward(torch.tensor([4, 5]), mask=mask)


@pytest.mark.parametrize("mask", [False, True])
def test_grouped_attention_on_cpu_changes_no_logit(tiny_pair, monkeypatch, mask):
    # load() sets TRANSFORMERS_SDPA_FORCE_GQA on CPU so verification skips the copy of repeated
    # key/value heads; the scores of a multi-token forward (causal or tree-masked) must not move.
    # transformers reads the variable from 5.23 on: before, the copies stay (pyproject allows 5.0).
    import transformers
    from packaging.version import Version
    from transformers.integrations import sdpa_attention

    from specbench.models.load import GROUPED_SDPA

    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or repeat_kv(*a))
    lm = wrap(load(tiny_pair[0], CPU, F32).model, False)
    assert lm.model.config.num_key_value_heads < lm.model.config.num_attention_heads  # the case it is for
    prefix, nodes = prompt_and_nodes(lm, 4)
    parents = [-1, 0, 0, 1]
    scores, copied = {}, {}
    for grouped in ("0", "1"):
        monkeypatch.setenv(GROUPED_SDPA, grouped)
        copies.clear()
        if mask:
            scores[grouped] = tree_round(lm, prefix, nodes, parents)
        else:
            lm.reset()
            lm.forward(prefix)
            scores[grouped] = lm.forward(torch.tensor(nodes), last=4)
        copied[grouped] = len(copies)
    honoured = Version(transformers.__version__) >= Version("5.23")
    assert copied["0"] > 0 and copied["1"] == (0 if honoured else copied["0"])  # the setting removes the copies...
    assert torch.equal(scores["0"], scores["1"])  # ...and nothing else


def test_the_growing_cache_appends_in_place_and_scores_as_transformers_own(target_model):
    from transformers import DynamicCache

    grown, plain = HFCausalLM(target_model, 320), HFCausalLM(target_model, 320)
    plain.reset = lambda: setattr(plain, "cache", DynamicCache(config=target_model.config))  # concatenating layers
    prompt = torch.arange(3, 203)
    for lm in (grown, plain):
        lm.reset()
        lm.forward(prompt)
    layer = grown.cache.layers[0]
    assert type(layer).__name__ == "GrowingLayer" and type(plain.cache.layers[0]).__name__ == "DynamicLayer"
    buffer = layer.grown.buffers[0].data_ptr()
    nodes = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    for step in range(12):  # tree rounds kept down to a path, chain rounds cropped, single tokens
        positions, mask = tree_inputs(PARENTS, plain.length, CPU)
        logits = []
        for lm in (grown, plain):
            if step % 3 == 0:
                logits.append(lm.forward(nodes, last=len(nodes), positions=positions, mask=mask))
                lm.keep(ACCEPTED, len(nodes))
            elif step % 3 == 1:
                logits.append(lm.forward(nodes[:4], last=4))
                lm.keep(range(2), 4)
            else:
                logits.append(lm.forward(nodes[step % 7 :][:1], last=1))
        torch.testing.assert_close(*logits)
        assert grown.length == plain.length
    torch.testing.assert_close(layer.keys, plain.cache.layers[0].keys)
    assert layer.grown.buffers[0].data_ptr() == buffer  # 200 + 24 tokens fit the first buffer: never copied again
