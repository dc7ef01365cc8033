"""The static path (models/static.py, --graphs): a cache that never moves, transformers' scores, no
recompilation across rounds, K and prompts, and exactness (greedy equality, the target's law under
sampling, and a deliberately broken cache that the law test catches). On a CPU the path runs compiled
by inductor without graphs; the cuda cases (make gpu-check) replay CUDA graphs."""

import contextlib
import copy
import logging
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specbench.bench.run import describe_forward
from specbench.decoding.decode import autoregressive_decode, speculative_decode
from specbench.decoding.kv import StaticKV
from specbench.decoding.sampling import Sampling, race, warp
from specbench.decoding.tree import tree_inputs
from specbench.drafters.model import ModelDrafter
from specbench.models import fast
from specbench.models import lm as lm_module
from specbench.models import static as static_path
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM, SparseView
from specbench.models.load import Wanted
from specbench.models.pair import default_graphs, load_pair, loop_lm
from specbench.models.static import StaticLM
from specbench.models.static_head import StaticHead

from ..families import FAMILIES, llama
from ..helpers import Dispatched, LawLM, tiny_law_model
from ..toy import P_FLOOR, SAMPLES, speculative_law_p

CPU = torch.device("cpu")
GREEDY = Sampling(temperature=0.0)

# How grouped heads attend under a mask: in the kernel (the CPU's route) or folded into the query
# length (CUDA's, fast.fold_groups), which these tests also run on the CPU.
ATTENTION = [pytest.param(False, id="grouped-kernel"), pytest.param(True, id="folded")]


def attention_route(monkeypatch, folded: bool) -> None:
    if folded:
        monkeypatch.setattr(fast, "kernel_takes_masked_groups", lambda device: False)


def noisy(model, scale: float = 0.3, seed: int = 1):
    """A draft for ``model``: its copy with noise of ``scale`` times each weight's spread, so that the
    target accepts some of its tokens and rejects others."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * scale * weight.std())
    return draft


def static(model, compiled: bool = False, head_tokens: torch.Tensor | None = None) -> StaticLM:
    width = model.config.vocab_size
    return StaticLM.of(model, width, head_tokens, compiled=compiled)


def scores(lm) -> list[torch.Tensor]:
    """Logits of a prefill, a chain, a one-token step after a rejection, a tree after another, and a
    chain after keeping a tree path that is not a prefix (which moves entries)."""
    lm.reset()
    out = [lm.forward(torch.arange(5, 40), last=2), lm.forward(torch.tensor([7, 8, 9, 10]), last=4)]
    lm.keep([0, 1], 4)
    out.append(lm.forward(torch.tensor([3]), last=1))
    positions, mask = tree_inputs([-1, 0, 0, 1], lm.length, CPU)
    out.append(lm.forward(torch.tensor([4, 5, 6, 7]), last=4, positions=positions, mask=mask))
    lm.keep([0, 2], 4)
    out.append(lm.forward(torch.tensor([3, 4, 5, 6, 7]), last=5))
    return out


@pytest.mark.parametrize("folded", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_static_path_scores_as_transformers(family, folded, monkeypatch):
    model = family(0)
    want = scores(HFCausalLM(model, model.config.vocab_size))
    attention_route(monkeypatch, folded)
    folds, fold = [], fast.fold_groups
    monkeypatch.setattr(fast, "fold_groups", lambda *args: folds.append(1) or fold(*args))
    got = scores(static(model))
    assert bool(folds) == folded  # the route the test names is the route that ran
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_a_rejection_moves_a_position_and_the_cache_never_moves():
    lm = static(llama(0))
    buffers = [t.data_ptr() for t in (*lm.kv.keys, *lm.kv.values)]
    lm.prefill(torch.arange(5, 30))
    lm.forward(torch.tensor([7, 8, 9, 10, 11]), last=5)
    held = lm.kv.keys[0][:, :, :27].clone()
    lm.keep([0, 1], 5)  # a chain's prefix: the length moves back, nothing is copied
    assert lm.length == 27 and torch.equal(lm.kv.keys[0][:, :, :27], held)
    lm.forward(torch.tensor([1, 2, 3]), last=3)
    positions, mask = tree_inputs([-1, 0, 0], lm.length, CPU)
    lm.forward(torch.tensor([4, 5, 6]), last=3, positions=positions, mask=mask)
    moved = lm.kv.values[1][:, :, 32].clone()  # the tree's third node
    lm.keep([0, 2], 3)  # a tree path: its second node moves next to the first
    assert lm.length == 32 and torch.equal(lm.kv.values[1][:, :, 31], moved)
    assert [t.data_ptr() for t in (*lm.kv.keys, *lm.kv.values)] == buffers


def test_a_sequence_beyond_the_reserved_cache_grows_it_and_says_so(caplog):
    model = llama(0)
    lm, want = static(model), HFCausalLM(model, model.config.vocab_size)
    lm.allocate(16)
    with caplog.at_level(logging.WARNING, logger="specbench"):
        got = [lm.prefill(torch.arange(5, 19)), lm.forward(torch.tensor([7, 8, 9, 10]), last=4)][1]
    want.prefill(torch.arange(5, 19))
    torch.testing.assert_close(got, want.forward(torch.tensor([7, 8, 9, 10]), last=4), rtol=1e-5, atol=1e-5)
    assert lm.kv.capacity >= 18 and "outgrew the static cache's 16 positions" in caplog.text


def test_a_reservation_holds_the_sequences_rounded_up_to_64_positions_from_256_within_the_window():
    # Attention reads every position the cache holds: a reservation rounded up further is read for nothing.
    model = llama(0)
    model.config.max_position_embeddings = 400
    lm = static(model)
    for tokens, positions in ((40, 256), (257, 320), (261, 320), (390, 400)):
        lm.reserve(tokens)
        assert lm.kv.capacity == positions, tokens


def test_the_static_path_is_cudas_default_and_says_why_a_model_is_not_on_it(tiny_pair, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    cuda = torch.device("cuda", 0)
    assert default_graphs(cuda, None) and default_graphs(cuda, True) and not default_graphs(cuda, False)
    assert not default_graphs(CPU, None)
    pair = load_pair(Wanted(*tiny_pair, device="cpu"), graphs=True)
    assert isinstance(pair.target_lm, StaticLM) and isinstance(pair.draft_lm, StaticLM)
    assert pair.target_lm.route == "static-inductor" and pair.target_lm.compiled is None  # compiled at reserve
    # What reserve builds has a progress line of its own (a 7B model's compiling takes minutes).
    assert pair.builds_at_reserve() == "compiling the static path's forwards"
    pair.draft_lm.graphed = True  # as on CUDA
    assert pair.builds_at_reserve() == "compiling the static path's forwards and capturing CUDA graphs"
    pair.target_lm.compiling = pair.draft_lm.compiling = False  # compiling failed, or is not wanted: nothing to build
    assert pair.builds_at_reserve() is None
    unstatic = load_pair(Wanted(*tiny_pair, device="cpu"))
    assert not isinstance(unstatic.target_lm, StaticLM) and unstatic.builds_at_reserve() is None
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with caplog.at_level(logging.INFO, logger="specbench"):
        lm = loop_lm(gpt2, 50, None, compile=False, graphs=True, name="gpt2")
    assert type(lm) is HFCausalLM and "gpt2 runs without the static path: the fast path covers" in caplog.text


@pytest.mark.parametrize("policy", ["retrieval", "window"])
def test_a_sparse_view_of_a_static_target_drafts_as_one_of_a_growing_cache(policy):
    # Self-speculation's draft reads the target's cache (lm.SparseView): the static cache shows it the same.
    model = llama(0)
    views = []
    for target in (HFCausalLM(model, model.config.vocab_size), static(model)):
        view = SparseView(target, budget=24, policy=policy)
        view.watch()
        target.prefill(torch.arange(5, 60))
        view.prefill(torch.arange(5, 60))
        target.forward(torch.tensor([7, 8, 9]), last=3)
        target.keep([0, 1], 3)
        views.append(view.forward(torch.tensor([8, 9, 10]), last=2))
    torch.testing.assert_close(views[1], views[0], rtol=1e-5, atol=1e-5)


def test_a_compiler_that_fails_leaves_the_static_path_eager_with_one_log_line(monkeypatch, caplog):
    def compile_without_a_compiler(function, **_):
        def fails(*args, **kwargs):
            raise RuntimeError("Cannot find a working triton installation\nmore detail")

        return fails

    monkeypatch.setattr(torch, "compile", compile_without_a_compiler)
    model = llama(0)
    lm = static(model, compiled=True)
    with caplog.at_level(logging.WARNING, logger="specbench"):
        lm.reserve(64)
    assert lm.route == "static" and lm.compiled is None
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile failed, the static path runs its forwards eagerly: Cannot find a working triton installation"
    ]
    for g, w in zip(scores(lm), scores(HFCausalLM(model, model.config.vocab_size)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_on_cuda_the_forwards_compile_with_coordinate_descent_tuning(monkeypatch, tmp_path):
    # gpt-fast's setting: inductor then runs each one-row product as a tuned reduction of its own. A CPU
    # passes nothing (the option changes nothing there); the forms of a model and of an EAGLE head get it.
    assert static_path.compile_options(torch.device("cuda")) == {"coordinate_descent_tuning": True}
    assert static_path.compile_options(CPU) is None
    asked = []
    monkeypatch.setattr(torch, "compile", lambda function, **kw: asked.append(kw["options"]) or function)
    tuned = {"coordinate_descent_tuning": True}

    def inputs(n):
        return [(torch.zeros(n), [0])]

    def negated(x):
        return -x

    forms = static_path.compile_forms(negated, negated, inputs, lambda form, x: form(x), "the test", tuned)
    assert [form(torch.ones(2)).tolist() for form in forms] == [[-1.0, -1.0]] * 2 and asked == [tuned, tuned]
    asked.clear()
    static(llama(0), compiled=True).reserve(64)
    assert asked == [None, None]
    from specbench.models.eagle_head import read_head

    from ..helpers import build_eagle3_head

    model = llama(0, layers=3)
    config, embed = model.config, model.get_input_embeddings().weight
    path = build_eagle3_head(tmp_path / "head", config, taps=(0, 1, 2))
    asked.clear()
    StaticHead(read_head(path, embed, 3, config.hidden_size, config.vocab_size), 64).ready()
    assert asked == [None, None]


def test_the_compiled_forms_score_the_vocabulary_themselves_unless_a_shortlist_does(monkeypatch, tmp_path):
    # gpt-fast compiles its whole decoder: inside the form, inductor lowers a one-token LM head to a tuned
    # reduction on CUDA, the final norm's scaling fused into it, where an eager head is cuBLAS's one-row product. What
    # the forms return is what the compiler was given (torch.compile the identity here).
    monkeypatch.setattr(torch, "compile", lambda function, **kw: function)
    model = llama(0)
    width, hidden = model.config.vocab_size, model.config.hidden_size

    def returned(lm) -> list[tuple[int, int]]:
        depth, tree = torch.zeros(1, dtype=torch.long), static_path.chain_tree(1, CPU)
        with torch.inference_mode():
            lm.prefill(torch.tensor([1, 2, 3]))
            return [tuple(form(lm, torch.tensor([4]), depth, tree, lm.start)[0].shape) for form in lm._forms(None)]

    whole, shortlisted = static(model, compiled=True), static(model, compiled=True, head_tokens=torch.arange(4))
    assert whole.scores_inside and not shortlisted.scores_inside
    assert returned(whole) == [(1, width)] * 2 and returned(shortlisted) == [(1, hidden)] * 2
    from specbench.models.eagle_head import read_head

    from ..helpers import build_eagle3_head

    model = llama(0, layers=3)
    path = build_eagle3_head(tmp_path / "head", model.config, taps=(0, 1, 2), draft_ids=[0, 2, 4, 5, 7])
    head = StaticHead(read_head(path, model.get_input_embeddings().weight, 3, hidden, width), 64)
    head.ready()
    head.start.fill_(0)
    ids, features, depth, tree = head._chain_buffers(1)
    with torch.inference_mode():
        assert [tuple(t.shape) for t in head.forms[0](head.head, head.kv, ids, features, depth, tree, head.start)] == [
            (1, hidden),
            (1, 5),
        ]


def test_static_kv_keeps_a_paths_entries_in_order():
    kv = StaticKV(layers=1, kv_heads=1, head_dim=2, capacity=8, dtype=torch.float32, device=CPU)
    kv.keys[0][0, 0, :, 0] = torch.arange(8.0)
    kv.length = 7  # 3 held, then 4 new
    kv.keep(torch.tensor([1, 3]), kept=2, new=4)
    assert kv.length == 5 and kv.keys[0][0, 0, :5, 0].tolist() == [0.0, 1.0, 2.0, 4.0, 6.0]


# ---------------------------------------------------------------- CUDA graphs' bookkeeping, on the CPU


# What a CUDA graph's capture cannot hold: a value read back to the host (a tensor's item, int(), a
# shape that depends on its values) or data from the host (a tensor made of Python values).
HOST_BOUND = {"_local_scalar_dense", "nonzero", "masked_select", "lift_fresh"}
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")  # in inference mode no
# operation is dispatched for these on a CPU


def refused(what: str):
    raise AssertionError(f"{what} in a captured forward: a CUDA graph cannot hold it")


class HostBound(TorchDispatchMode):
    """Raises at any operation of HOST_BOUND dispatched within it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_BOUND:
            refused(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_free():
    """Within it, reading a tensor's value on the host or making one of Python values raises."""
    with HostBound(), pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, lambda *_, name=name: refused(f"Tensor.{name}"))
        yield


class ReplayedOnCPU(static_path.Graph):
    """A CUDA graph's contract kept on the CPU: the capture keeps the forward and its outputs, and
    nothing in it reads back to the host or from it (host_free); a replay reads its inputs only from
    the graph's buffers and writes the same output tensors again. What the path forgets to copy in (a
    tree's mask after a chain of as many tokens), or keeps of an output past the next replay, then
    comes out wrong here as on a GPU; the CUDA calls themselves run in make gpu-check."""

    replays = 0

    def capture(self, run, pool):
        self.run = run
        with host_free():
            return run(*self.buffers)

    def replay(self) -> None:
        self.replays += 1
        out = self.run(*self.buffers)
        for held, new in zip(self.out, out if isinstance(out, tuple) else (out,), strict=True):
            if held is not None:
                held.copy_(new)


REPLAYED = "replayed"  # the law tests' route: graphs replayed on the CPU


def graphs_on_cpu(monkeypatch) -> None:
    """Graphs replayed on the CPU (ReplayedOnCPU), over the forwards uncompiled: what is under test is
    the graphs' bookkeeping, not inductor (whose forms the compiled tests below cover)."""
    monkeypatch.setattr(static_path, "Graph", ReplayedOnCPU)
    monkeypatch.setattr(static_path, "compile_forms", lambda one, many, *_: (one, many))


def replay_on_cpu(lm):
    """``lm`` (a StaticLM or StaticHead made with compiled=True, after graphs_on_cpu) taking the CUDA
    route: its forwards captured (at reserve) and replayed."""
    lm.graphed = True
    return lm


def replayed(lm) -> set:
    """The graphs (their keys) that ``lm``'s forwards replayed."""
    return {key for key, graph in lm.graphs.items() if graph.replays}


def switching(lm, fresh: int = 0) -> list[torch.Tensor]:
    """Logits of a prompt, then of one graph's token count read as a chain, as a tree, and as a chain
    again (its buffers hold the other's depth and mask each time), with rejections between them;
    ``fresh`` is added to the ids read after the prompt (100: none of them is one the prompt read)."""

    def ids(*values: int) -> torch.Tensor:
        return torch.tensor(values) + fresh

    lm.reset()
    out = [lm.forward(torch.arange(5, 40), last=1), lm.forward(ids(7, 8, 9, 10), last=4)]
    lm.keep([0, 1], 4)
    positions, mask = tree_inputs([-1, 0, 0, 1], lm.length, CPU)
    out.append(lm.forward(ids(4, 5, 6, 7), last=4, positions=positions, mask=mask))
    lm.keep([0, 2], 4)
    out.append(lm.forward(ids(3, 4, 5, 6), last=4))
    lm.keep([0], 4)
    out += [lm.forward(ids(9), last=1), lm.forward(ids(1, 2, 3), last=3)]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_graphs_score_as_transformers_and_no_prompt_is_captured(family, monkeypatch):
    graphs_on_cpu(monkeypatch)
    model = family(0)
    lm = replay_on_cpu(static(model, compiled=True))
    lm.reserve(64)
    assert lm.route == "graphs"
    # Captured at reserve: 1 to CAPTURED_AT_LEAST tokens, before anything would be timed.
    captured = {(n, None) for n in range(1, static_path.CAPTURED_AT_LEAST + 1)}
    assert set(lm.graphs) == captured and not replayed(lm)
    for got, want in zip(switching(lm), switching(HFCausalLM(model, model.config.vocab_size)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(lm.graphs) == captured and replayed(lm) == {(1, None), (3, None), (4, None)}


def decode_as_the_baseline(target, draft, lengths) -> None:
    """Greedy speculative decodes at K 2 and 4 of prompts of ``lengths`` equal the baseline's, with rounds
    that kept drafts and rounds that moved the cache back."""
    generator = torch.Generator().manual_seed(0)
    accepted = drafted = 0
    for length in lengths:
        prompt = torch.arange(3, 3 + length)
        want = autoregressive_decode(target, prompt, 40, GREEDY, generator).tokens
        for k in (2, 4):
            got = speculative_decode(target, ModelDrafter(draft, GREEDY, generator), prompt, k, 40, GREEDY, generator)
            assert got.tokens == want, f"prompt of {length}, K={k}"
            accepted, drafted = accepted + got.accepted, drafted + got.drafted
    assert 0 < accepted < drafted


def replayed_pair(monkeypatch) -> tuple[StaticLM, StaticLM]:
    """A 3-layer Llama and a noisy copy as its draft, on graphs replayed on the CPU, reserved for K = 4."""
    graphs_on_cpu(monkeypatch)
    model = llama(0, layers=3)
    target, draft = (replay_on_cpu(static(m, compiled=True)) for m in (model, noisy(model)))
    for lm in (target, draft):
        lm.reserve(96, widest=5)
    return target, draft


def test_replayed_graphs_decode_the_baselines_greedy_tokens(monkeypatch):
    # Prompts of lengths no decode forward has (a prompt runs uncompiled: a graph per prompt length
    # would be captured inside the timed run). The target replays 1 token (the baseline) and K + 1,
    # the draft 1 and 2 (catching up) and then its chain of K - 1 forwards and K draws as one graph;
    # nothing is captured after reserve but the draft's chains, at its first (a run's warm-up).
    target, draft = replayed_pair(monkeypatch)
    draft.reserve_chains(GREEDY)  # as Pair.reserve does with the run's sampling
    warp = static_path.chain_warp(GREEDY)
    assert set(draft.chained) == {(n, warp) for n in range(1, static_path.CHAINED_UP_TO + 1)}
    captured = [{*lm.graphs, *lm.chained} for lm in (target, draft)]
    decode_as_the_baseline(target, draft, (9, 17, 30))
    assert [{*lm.graphs, *lm.chained} for lm in (target, draft)] == captured
    assert replayed(target) == {(1, None), (3, None), (5, None)} and replayed(draft) == {(1, None), (2, None)}
    assert {key for key, graph in draft.chained.items() if graph.replays} == {(2, warp), (4, warp)}
    facts = target.forward_facts()
    assert facts["captured"] == static_path.CAPTURED_AT_LEAST
    logits_mb = sum(range(1, static_path.CAPTURED_AT_LEAST + 1)) * target.model.config.vocab_size * 4 / 2**20
    assert facts["graphs_mb"] == pytest.approx(logits_mb)  # each graph holds its logits: the head runs inside
    line = describe_forward("target", facts)
    assert re.search(r"16 CUDA graphs captured in [\d.]+ s, outputs 0 MB; cache 192 kB for 256 positions", line)


# Every id below 40 but 0 (what a capture's made-up inputs read), then every third one.
SHORTLIST = torch.cat([torch.arange(1, 40), torch.arange(40, 300, 3)])


@pytest.mark.parametrize("spare", [lm_module.SPARE_ROWS, 2], ids=["rows-to-spare", "a-row-per-position"])
def test_a_shortlisted_head_scores_inside_the_replayed_graphs_as_outside(spare, monkeypatch):
    # A shortlisted draft (the shipped one) runs its head inside the graph: the ids read are appended
    # on the device and every row is scored. Two sequences score as transformers' forward with the
    # same shortlist: the first reads ids on it, the second's graphed forwards read ids off it. The
    # graphs captured at reserve serve both, however few rows a shortlist keeps free by default:
    # reserve holds one for each position of the cache. A capture's made-up ids leave no trace (id 0
    # scores -inf throughout).
    monkeypatch.setattr(lm_module, "SPARE_ROWS", spare)
    graphs_on_cpu(monkeypatch)
    model = llama(0)
    lm = replay_on_cpu(static(model, compiled=True, head_tokens=SHORTLIST))
    lm.reserve(64)
    free = len(lm.shortlist.ids) - 1 - len(SHORTLIST)
    assert free >= min(lm.kv.capacity, model.config.vocab_size - len(SHORTLIST))  # every id it could read
    captured = dict(lm.graphs)
    want = HFCausalLM(model, model.config.vocab_size, SHORTLIST)
    for fresh in (0, 100):
        for got, expected in zip(switching(lm, fresh), switching(want, fresh), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert torch.isinf(got[:, 0]).all()
    assert replayed(lm) == {(1, None), (3, None), (4, None)}
    assert all(lm.graphs.get(key) is graph for key, graph in captured.items())


def test_a_shortlist_whose_rows_run_out_grows_and_its_graphs_are_captured_again(monkeypatch):
    # More new ids in one sequence than its cache has positions, read and rejected round after round
    # (no drafter of specbench's makes a draft model read ids so, but the forward must not depend on
    # it). The buffers grow, the graphs over the old ones are captured again, and the scores stay
    # transformers'.
    graphs_on_cpu(monkeypatch)
    model = llama(0, vocab=1024)
    lm = replay_on_cpu(static(model, compiled=True, head_tokens=SHORTLIST))
    lm.reserve(64)
    rows = len(lm.shortlist.ids)
    captured = dict(lm.graphs)
    want = HFCausalLM(model, model.config.vocab_size, SHORTLIST)
    for m in (lm, want):
        m.reset()
    fresh = iter(range(300, 1024))  # none of them shortlisted
    prompt = torch.arange(5, 40)
    torch.testing.assert_close(lm.forward(prompt, last=1), want.forward(prompt, last=1), rtol=1e-5, atol=1e-5)
    for _ in range(lm.kv.capacity // 4 + 1):  # 4 new ids a round, one kept
        ids = torch.tensor([next(fresh) for _ in range(4)])
        torch.testing.assert_close(lm.forward(ids, last=4), want.forward(ids, last=4), rtol=1e-5, atol=1e-5)
        for m in (lm, want):
            m.keep([0], 4)
    assert len(lm.shortlist.ids) > rows and lm.length == 35 + lm.kv.capacity // 4 + 1
    assert (4, None) in replayed(lm) and lm.graphs[(4, None)] is not captured[(4, None)]


# ---------------------------------------------------------------- compiled: never recompiled, exact


@pytest.mark.slow
@pytest.mark.parametrize("folded", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_path_never_recompiles_and_decodes_the_baselines_greedy_tokens(
    family, folded, monkeypatch, one_thread
):
    # Rounds, K (2 and 4: verify forwards of 3 and 5 tokens, draft catch-ups of 1 and 2) and prompts
    # of several lengths: every forward after the build reuses the two compiled graphs, and models
    # of other shapes compiled in the same process (the draft, another test's) leave them alone.
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    attention_route(monkeypatch, folded)
    other = static(llama(2, layers=1, hidden=32), compiled=True)  # another model in the process, of another shape
    other.reserve(40)
    model = family(0, layers=3)
    target, draft = static(model, compiled=True), static(noisy(model), compiled=True)
    for lm in (target, draft):
        lm.reserve(96)
    assert target.route == draft.route == "static-inductor" and target.compiled is not None
    buffers = [t.data_ptr() for t in (*target.kv.keys, *target.kv.values)]
    decode_as_the_baseline(target, draft, (5, 11, 23))
    assert [t.data_ptr() for t in (*target.kv.keys, *target.kv.values)] == buffers


class ReplayedCompiled(ReplayedOnCPU):
    """ReplayedOnCPU over compiled forms: its capture runs outside host_free, a dispatch mode, within
    which torch.compile leaves its frames uncompiled."""

    def capture(self, run, pool):
        self.run = run
        return run(*self.buffers)


def test_a_drafted_chain_draws_what_a_token_at_a_time_draws_from_the_same_draws(monkeypatch):
    # Each token of the chain's graph against its own q row (the law test cannot see rows one place
    # off on its model): the same forwards, warp and races as drafting a token at a time, under a warp
    # that cuts (top-k, top-p, min-p) and a temperature, with the graph's draws raced again here.
    graphs_on_cpu(monkeypatch)
    draft = replay_on_cpu(static(llama(0, layers=2), compiled=True))
    draft.reserve(96, widest=6)
    cut = Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)
    with torch.inference_mode():
        draft.forward(torch.arange(3, 20), last=1)
        assert draft.chains(5, cut, 1) and not draft.chains(5, replace(cut, repetition_penalty=1.2), 1)
        read = draft.length
        first = draft.forward(torch.tensor([7]), last=1)[-1]
        tokens, rows = draft.draft_chain(first, 5, cut, torch.Generator().manual_seed(3))
        assert draft.length == read + 5  # the catch-up's token and all drafts but the last
        draws = draft.chained[5, static_path.chain_warp(cut)].buffers[1].clone()
        draft.keep([], draft.length - read)
        row, one_by_one, q_rows = draft.forward(torch.tensor([7]), last=1)[-1], [], []
        for i in range(5):
            if i:
                row = draft.forward(one_by_one[-1], last=1)[-1]
            q_rows.append(warp(row, cut))
            one_by_one.append(race(q_rows[-1], draws[i].clone()))
    assert torch.equal(tokens, torch.cat(one_by_one)) and torch.equal(rows, torch.stack(q_rows))
    assert len(set(tokens.tolist())) > 1  # the draws decided: not every row's likeliest


def test_a_chain_whose_graph_is_gone_is_drafted_a_token_at_a_time(monkeypatch):
    # chains() said yes, then the catch-up forward's own capture failed and dropped the chains: the
    # drafter goes on a token at a time from the row it read, and decodes as the baseline.
    target, draft = replayed_pair(monkeypatch)
    monkeypatch.setattr(draft, "chains", lambda *args: True)
    decode_as_the_baseline(target, draft, (9, 17))
    assert not draft.chained


@pytest.mark.slow
def test_a_drafted_chain_calls_the_compiled_forward_without_recompiling(monkeypatch, one_thread):
    # The chain's graph calls the one-token form once a drafted token, each at a first slot it computes
    # on the device: the form traced at reserve must serve them all (a recompile inside a capture fails it).
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    monkeypatch.setattr(static_path, "Graph", ReplayedCompiled)  # the forms stay compiled, the graphs run here
    model = llama(0, layers=2)
    target, draft = (replay_on_cpu(static(m, compiled=True)) for m in (model, noisy(model)))
    for lm in (target, draft):
        lm.reserve(96, widest=5)
    decode_as_the_baseline(target, draft, (9, 17))
    assert any(graph.replays for graph in draft.chained.values())


class StaticLawLM(StaticLM):
    """A tiny Llama of VOCAB tokens on the static path, with its exact law (LawLM.logits_after)."""

    def __init__(self, model):
        super().__init__(
            model, model.config.vocab_size, None, FastLlama(model, packed=False, compiled=False, joined=True)
        )
        self.vocab = model.config.vocab_size

    logits_after = LawLM.logits_after


# CPU: compiled by inductor, and the graphs' bookkeeping with each graph replayed on the CPU
# (ReplayedOnCPU); CUDA: graphed, its grouped heads folded (make gpu-check runs those). Slow on the CPU:
# 6,000 decodes each, 40 to 55 s on 2 busy cores. The folded route has no law test of its own on the CPU:
# its logits equal transformers' for every kind of forward the loop makes
# (test_the_static_path_scores_as_transformers) and its compiled greedy decodes the baseline's, so a law
# test would add only the bookkeeping, which both routes share and the tests below cover.
DEVICES = [
    pytest.param("cpu", id="static-inductor", marks=pytest.mark.slow),
    pytest.param(REPLAYED, id="graphs-replayed-on-cpu", marks=pytest.mark.slow),
    pytest.param("cuda", id="graphs", marks=pytest.mark.gpu),
]


def attentive(model):
    """``model`` reading its context more. tiny_law_model scales its embeddings up so that its law is
    far from uniform, which leaves attention little say: a cache holding the wrong tokens then moves
    the law too little to see (a mask that let drafts see ahead scored p = 0.17 on it). Here the
    embeddings are as initialised, attention's output is amplified, and the head sharpens the law."""
    with torch.no_grad():
        model.get_input_embeddings().weight.div_(8)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(8)
        model.get_output_embeddings().weight.mul_(HEAD_GAIN)
    return model


HEAD_GAIN = 10.0


def static_law_p(tmp_path, device: str, negative_control: bool = False, samples: int = SAMPLES) -> float:
    replayed, device = device == REPLAYED, "cpu" if device == REPLAYED else device
    target, draft = (StaticLawLM(attentive(tiny_law_model(seed, tmp_path, device))) for seed in (1, 2))
    if replayed:
        target, draft = replay_on_cpu(target), replay_on_cpu(draft)
    assert {target.route, draft.route} == {"graphs" if device == "cuda" or replayed else "static-inductor"}
    cfg, generator = Sampling(temperature=1.0), torch.Generator(device=device).manual_seed(0)
    drafter = ModelDrafter(draft, cfg, generator)
    p = speculative_law_p(target, drafter, 2, cfg, generator, samples=samples, negative_control=negative_control)
    assert bool(draft.chained) == (device == "cuda" or replayed)  # graphed, the chains are drafted in one go
    return p


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_sampling_on_the_static_path_matches_the_target_law(tmp_path, one_thread, monkeypatch, device):
    if device == REPLAYED:
        graphs_on_cpu(monkeypatch)
    assert static_law_p(tmp_path, device) > P_FLOOR


def test_the_graphed_path_gives_the_target_law_quickly(tmp_path, one_thread, monkeypatch):
    """The fast set's check (and test-lowest's) of the graphs' bookkeeping: a third of the samples, the
    graphs replayed on the CPU (the slow tests above draw them all)."""
    graphs_on_cpu(monkeypatch)
    assert static_law_p(tmp_path, REPLAYED, samples=SAMPLES // 3) > P_FLOOR


@pytest.mark.parametrize("device", DEVICES)
def test_the_test_catches_a_mask_that_lets_drafts_see_ahead(tmp_path, one_thread, monkeypatch, device):
    # A bug of the static path's own: a verification mask that lets each new token see every new slot,
    # the drafts after it included, so each row is scored on tokens not yet emitted. (A rejection that
    # left the rejected slot inside the length was tried too: it moved the law of these 4-token
    # sequences too little for the test to see, p = 0.14.)
    mask = static_path.static_mask
    monkeypatch.setattr(
        static_path, "static_mask", lambda start, tree, *rest: mask(start, torch.ones_like(tree), *rest)
    )
    if device == REPLAYED:
        graphs_on_cpu(monkeypatch)
    assert static_law_p(tmp_path, device, negative_control=True) < P_FLOOR


@pytest.mark.parametrize("device", DEVICES[1:])
def test_the_test_catches_a_drafted_chain_whose_graph_never_reads_its_draws(tmp_path, one_thread, monkeypatch, device):
    # A bug a chain drafted in one graph could have: the draws made outside it land in a buffer the graph
    # does not read, so every race is run over the same numbers and each token is its row's likeliest,
    # while it is verified as a sample of the row (a q row rolled one place off instead scored p = 0.30).
    chain = static_path.draw_chain

    def stale_draws(first, k, sampling, draws, row_after):
        return chain(first, k, sampling, torch.ones_like(draws), row_after)

    monkeypatch.setattr(static_path, "draw_chain", stale_draws)
    if device == REPLAYED:
        graphs_on_cpu(monkeypatch)
    assert static_law_p(tmp_path, device, negative_control=True) < P_FLOOR


@pytest.mark.slow
def test_an_eagle_targets_features_come_from_the_compiled_path(tmp_path, monkeypatch, one_thread):
    # An EAGLE head drafts from the target's features: the target records them inside its compiled
    # forwards (a form of their own, for these taps), as transformers' eager forward gives them, and
    # the head's greedy decode over the static target is the baseline's.
    from specbench.drafters.eagle import EagleDrafter
    from specbench.models.eagle_head import read_head

    from ..helpers import build_eagle3_head

    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    model = llama(0, layers=4)
    config = model.config
    head = read_head(
        build_eagle3_head(tmp_path / "head", config, taps=(0, 2, 3), seed=3),
        model.get_input_embeddings().weight,
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
    )
    target, eager = static(model, compiled=True), HFCausalLM(model, config.vocab_size)
    target.reserve(96)
    for lm in (target, eager):
        lm.record_features(head.config.taps)
    features = []
    for lm in (target, eager):
        lm.prefill(torch.arange(5, 30))
        lm.forward(torch.tensor([7]), last=1)
        one = lm.features
        lm.forward(torch.tensor([8, 9, 10]), last=3)
        features.append((one, lm.features))
    for got, want in zip(*features, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert tuple(head.config.taps) in target.compiled
    prompt, generator = torch.arange(3, 20), torch.Generator().manual_seed(0)
    target.record_features(None)
    want = autoregressive_decode(target, prompt, 30, GREEDY, generator).tokens
    target.record_features(head.config.taps)
    drafter = EagleDrafter(head, target, 3, GREEDY, generator)
    assert speculative_decode(target, drafter, prompt, 3, 30, GREEDY, generator).tokens == want


# ---------------------------------------------------------------- the EAGLE head's steps


def static_eagle(tmp_path, seed: int = 3, compiled: bool = True, replayed: bool = False, device: str = "cpu"):
    """A compiled static law target, an EAGLE head for it (taps 0, 1 and its final states, two of
    three ids), and that head on the static path, on ``device``; with ``replayed``, both on graphs
    replayed on the CPU (after graphs_on_cpu)."""
    from specbench.models.eagle_head import read_head

    from ..helpers import build_eagle3_head

    target = StaticLawLM(attentive(tiny_law_model(1, tmp_path, device)))
    config = target.model.config
    path = build_eagle3_head(tmp_path / f"head{seed}", config, taps=(0, 1, 2), draft_ids=[0, 2], seed=seed, scale=1.0)
    embed = target.model.get_input_embeddings().weight
    head = read_head(path, embed, config.num_hidden_layers, config.hidden_size, config.vocab_size).to(device)
    static_head = StaticHead(head, 64, compiled=compiled)
    if replayed:
        replay_on_cpu(target), replay_on_cpu(static_head)
    target.reserve(64, taps=head.config.taps)
    static_head.reserve(64)
    target.record_features(head.config.taps)
    return target, head, static_head


def assert_eagle_decodes_alike(reference, tested, prompts, shape: dict) -> None:
    """Greedy EAGLE decodes (K = 3) of ``prompts`` by the (target, head) pairs ``reference`` and
    ``tested`` give the same tokens and accepted counts, round for round, some accepted."""
    from specbench.drafters.eagle import EagleDrafter

    runs = []
    for lm, drafting in (reference, tested):
        generator = torch.Generator().manual_seed(0)
        counts = []
        for prompt in prompts:
            drafter = EagleDrafter(drafting, lm, 3, GREEDY, generator, **shape)
            result = speculative_decode(lm, drafter, torch.tensor(prompt, device=lm.device), 3, 24, GREEDY, generator)
            counts.append((result.tokens, result.accept_counts))
        runs.append(counts)
    assert runs[0] == runs[1]
    assert 0 < sum(sum(accepts) for _, accepts in runs[1])


@pytest.mark.slow
@pytest.mark.parametrize("folded", ATTENTION)
@pytest.mark.parametrize("shape", [{}, {"shape": (2, 1)}, {"dynamic": (3, 2)}], ids=["chain", "tree", "dynamic"])
def test_the_static_head_drafts_as_the_head_itself(tmp_path, monkeypatch, one_thread, shape, folded):
    # The same drafts, round for round, so the same accepted counts: chains and tree levels through the
    # compiled steps, neither recompiling.

    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    attention_route(monkeypatch, folded)
    target, head, static_head = static_eagle(tmp_path)
    assert static_head.forward_facts()["route"] == "static-inductor" and static_head.forms is not None
    prompts = ([0, 2], [1, 1, 0], [2, 0, 1, 1, 2])
    assert_eagle_decodes_alike((target, head), (target, static_head), prompts, shape)


def static_eagle_law_p(tmp_path, replayed: bool, negative_control: bool = False) -> float:
    """The law test of EAGLE chains (K = 3) on the static path: compiled, or on graphs replayed on the
    CPU, where the head drafts each chain in one graph (after graphs_on_cpu)."""
    from specbench.drafters.eagle import EagleDrafter

    target, _, static_head = static_eagle(tmp_path, replayed=replayed)
    cfg, generator = Sampling(temperature=1.0), torch.Generator().manual_seed(0)
    drafter = EagleDrafter(static_head, target, 3, cfg, generator)
    p = speculative_law_p(target, drafter, 3, cfg, generator, negative_control=negative_control)
    assert any(graph.replays for graph in static_head.chained.values()) == replayed
    return p


@pytest.mark.parametrize("replayed", [pytest.param(False, id="static-inductor"), pytest.param(True, id=REPLAYED)])
@pytest.mark.slow
def test_eagle_on_the_static_path_gives_the_target_law(tmp_path, one_thread, monkeypatch, replayed):
    if replayed:
        graphs_on_cpu(monkeypatch)
    assert static_eagle_law_p(tmp_path, replayed) > P_FLOOR


@pytest.mark.slow
def test_the_test_catches_an_eagle_chain_whose_graph_never_reads_its_draws(tmp_path, one_thread, monkeypatch):
    # As for a draft model's chain: the head's chain graph racing over numbers it was captured with.
    chain = static_path.draw_chain
    monkeypatch.setattr(
        static_path,
        "draw_chain",
        lambda first, k, sampling, draws, row_after: chain(first, k, sampling, torch.ones_like(draws), row_after),
    )
    graphs_on_cpu(monkeypatch)
    assert static_eagle_law_p(tmp_path, True, negative_control=True) < P_FLOOR


class KeepsNothing(static_path.Graph):
    """A graph that, as a CUDA graph, keeps nothing alive of what its capture read: only its buffers."""

    def capture(self, run, pool):
        return run(*self.buffers)

    def replay(self) -> None:
        raise AssertionError("not replayed here")


def test_what_a_chains_graph_reads_outlives_its_capture(tmp_path, monkeypatch):
    # The tests that replay graphs on the CPU keep the captured function, and with it every tensor it
    # closed over; a CUDA graph does not, and a tensor made for the capture alone is freed after it,
    # its memory reused while the graph still reads it (the head's chains once held their positions
    # and mask so). The depth and tree every chain's steps read must be among the graph's buffers.
    import gc
    import weakref

    graphs_on_cpu(monkeypatch)
    monkeypatch.setattr(static_path, "Graph", KeepsNothing)
    made = []
    for owner, name in ((StaticHead, "_chain_shape"), (static_path, "chain_tree")):
        original = getattr(owner, name)

        def spy(*args, original=original):
            out = original(*args)
            made.extend(weakref.ref(t) for t in (out if isinstance(out, tuple) else (out,)))
            return out

        monkeypatch.setattr(owner, name, spy)
    _, _, static_head = static_eagle(tmp_path, replayed=True)
    draft = replay_on_cpu(static(llama(0, layers=2), compiled=True))
    draft.reserve(96, widest=5)
    for lm in (static_head, draft):
        made.clear()
        lm.reserve_chains(GREEDY)
        gc.collect()
        assert lm.chained and made and all(ref() is not None for ref in made), type(lm).__name__


def test_an_eagle_chain_drawn_in_one_graph_draws_what_a_step_at_a_time_draws(tmp_path, monkeypatch):
    # The chain's graph against the head's own steps, token for token and row for row, from its draws.
    graphs_on_cpu(monkeypatch)
    target, head, static_head = static_eagle(tmp_path, replayed=True)
    cut = Sampling(temperature=0.8, top_k=2)
    with torch.inference_mode():
        target.prefill(torch.tensor([0, 2, 1, 1, 0]))
        cache = static_head.new_cache()
        out, logits = static_head.scored_step(torch.tensor([2, 1, 1, 0]), head.fuse(target.features[:4]), cache)
        start = cache.length
        assert static_head.chains(4, cut)
        ids, rows = static_head.draft_chain(logits[0], out, 4, cut, torch.Generator().manual_seed(3))
        assert cache.length == start + 3  # every draft but the last read
        draws = static_head.chained[4, static_path.chain_warp(cut)].buffers[2].clone()
        cache.crop(start)
        row, one_by_one, q_rows = logits[0], [], []
        for i in range(4):
            if i:
                out, scores = static_head.scored_step(head.draft_ids[one_by_one[-1]], out, cache)
                row = scores[0]
            q_rows.append(warp(row, cut))
            one_by_one.append(race(q_rows[-1], draws[i].clone()))
    assert torch.equal(ids, torch.cat(one_by_one)) and torch.equal(rows, torch.stack(q_rows))


@pytest.mark.gpu
def test_an_eagle_pair_on_cuda_graphs_drafts_as_transformers_and_the_head(tmp_path, one_thread):
    # The CUDA captures themselves (the tests above replay their bookkeeping on the CPU): the target's
    # verification with its features, the head's reads of a round's pairs, its chains in one graph and
    # the levels of EAGLE-2's dynamic trees, all replayed graphs, draft round for round as the eager
    # head over transformers' forward.
    target, head, static_head = static_eagle(tmp_path, device="cuda")
    assert target.route == static_head.forward_facts()["route"] == "graphs"
    eager = HFCausalLM(target.model, target.vocab)
    eager.record_features(head.config.taps)
    prompts = ([0, 2, 1, 1, 0, 2, 2, 1, 0, 1], [1, 1, 0, 2, 0, 0, 1, 2, 2, 1, 0, 1, 2])
    for shape in ({}, {"dynamic": (3, 2)}):
        assert_eagle_decodes_alike((eager, head), (target, static_head), prompts, shape)
    assert static_head.chained  # captured at the first chain, which then replayed them


@pytest.mark.gpu
def test_after_a_capture_fails_memory_is_still_freed_and_the_next_capture_replays():
    # torch ends a failed capture with an error before it tells its caching allocator that capturing is
    # over (CUDAGraph::capture_end): Graph tells it, or empty_cache asserts and every later capture fails.
    pool, x = torch.cuda.graph_pool_handle(), torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        static_path.Graph(lambda t: t * t.sum().item(), (x,), pool)  # a read by the host: not capturable
    torch.cuda.empty_cache()
    doubled = static_path.Graph(lambda t: 2 * t, (x,), pool)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert doubled(torch.full((4,), 3.0, device="cuda"))[0].tolist() == [6.0] * 4


def test_greedy_chains_share_their_graphs_whatever_the_truncation_and_sampled_ones_do_not():
    key = static_path.chain_warp
    assert key(Sampling(temperature=0.0, top_k=5, top_p=0.9)) == key(Sampling(temperature=0.0))  # one argmax
    assert key(Sampling(temperature=1.0, top_k=5)) != key(Sampling(temperature=1.0))


def test_a_capture_that_fails_leaves_the_forwards_compiled_with_one_log_line(tmp_path, monkeypatch, caplog):
    # Graphs are CUDA's default: an operation some torch version cannot capture must not end the run.
    # The target and the head each say it once, their routes say what ran, and they decode as before.
    graphs_on_cpu(monkeypatch)

    def cannot(self, run, pool):  # as torch.cuda.graph fails: ending the capture fails after the operation
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None

    monkeypatch.setattr(ReplayedOnCPU, "capture", cannot)
    with caplog.at_level(logging.WARNING, logger="specbench"):
        target, head, static_head = static_eagle(tmp_path, replayed=True)
    said = "capturing a CUDA graph failed, {} compiled: CUDA error: operation not permitted when stream is capturing"
    assert [r.getMessage() for r in caplog.records] == [
        said.format("the static path runs its forwards"),
        said.format("the EAGLE head runs its steps"),
    ]
    assert target.route == static_head.forward_facts()["route"] == "static-inductor"
    assert not target.graphs and not static_head.graphs
    eager = HFCausalLM(target.model, target.vocab)
    eager.record_features(head.config.taps)
    prompts = ([0, 2, 1, 1, 0, 2, 2, 1, 0, 1], [1, 1, 0, 2, 0, 0, 1, 2, 2, 1, 0, 1, 2])
    assert_eagle_decodes_alike((eager, head), (target, static_head), prompts, {})


@pytest.mark.parametrize(
    ("shape", "verified"), [({}, 4), ({"shape": (2, 1)}, 5), ({"dynamic": (3, 2)}, 4)], ids=["chain", "tree", "dynamic"]
)
def test_replayed_graphs_of_an_eagle_pair_draft_as_transformers_and_the_head(
    tmp_path, monkeypatch, one_thread, shape, verified
):
    # The target's features come out of its graphs (a graph of their own per token count), the head's
    # steps are graphs, chains and tree levels alike: round for round the drafts and accepted counts
    # of the head over transformers' forward. The prompts' reads stay uncaptured.

    graphs_on_cpu(monkeypatch)
    target, head, static_head = static_eagle(tmp_path, replayed=True)
    eager = HFCausalLM(target.model, target.vocab)
    eager.record_features(head.config.taps)
    prompts = ([0, 2, 1, 1, 0, 2, 2, 1, 0, 1], [1, 1, 0, 2, 0, 0, 1, 2, 2, 1, 0, 1, 2])
    assert_eagle_decodes_alike((eager, head), (target, static_head), prompts, shape)
    # The target's verification (K + 1, or the tree's nodes and its root), its features with it, and
    # the head's chain steps (1 to K + 1 pairs) replayed graphs; neither the prompts' 10 or 13 tokens.
    assert replayed(target) == {(verified, tuple(head.config.taps))}
    assert replayed(static_head) and replayed(static_head) <= {1, 2, 3, 4}
    captured = range(1, static_path.CAPTURED_AT_LEAST + 1)
    assert set(target.graphs) == {(n, layers) for n in captured for layers in (None, tuple(head.config.taps))}
    assert set(static_head.graphs) == set(captured)


def test_a_graphed_chain_step_of_the_head_scores_inside_its_graph(tmp_path, monkeypatch, one_thread):
    # Around a chain step's replay the host only copies the inputs in (a chain's depth and tree are in
    # the buffers already), sets the first slot and copies the outputs out: the head's final norm and its product run inside the graph, and what they give
    # is the head's own output and scores.
    graphs_on_cpu(monkeypatch)
    target, head, static_head = static_eagle(tmp_path, replayed=True)
    prompt, token = torch.tensor([0, 2, 1, 1, 0]), torch.tensor([2])
    with torch.inference_mode():
        features = torch.randn(len(prompt), head.config.hidden)
        cache, own = static_head.new_cache(), head.new_cache()
        out, _ = static_head.scored_step(prompt, features, cache)  # a sequence's first read is the head's own
        head.scored_step(prompt, features, own)
        with Dispatched() as around, monkeypatch.context() as patch:
            patch.setattr(ReplayedOnCPU, "replay", lambda graph: around.ops.update(["replay"]))
            static_head.scored_step(token, out, cache)
        assert around.ops == Counter({"clone": 2, "copy_": 2, "fill_": 1, "replay": 1})
        cache.crop(len(prompt))
        got, want = static_head.scored_step(token, out, cache), head.scored_step(token, out, own)
    assert replayed(static_head) == {1}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["own", "replayed"])
def test_a_tree_levels_node_reads_as_the_chain_of_its_branch(tmp_path, monkeypatch, one_thread, which):
    # The tree's meaning: a node at the second level, seeing the pairs before the tree, its ancestor
    # at the first level and itself, gives what reading its branch as a chain gives; its sibling
    # branch's node, cached between them, is not seen. For the head's own step and its replayed graphs
    # (the same graph of two pairs serving the chains and the level, switching buffers).
    graphs_on_cpu(monkeypatch)
    _, head, static_head = static_eagle(tmp_path, replayed=True)
    lm = head if which == "own" else static_head
    g = torch.Generator().manual_seed(0)
    prompt, features = torch.tensor([0, 2, 1, 1, 0]), torch.randn(5, head.config.hidden, generator=g)
    first, second = torch.tensor([1, 2]), torch.tensor([2, 0])  # second[i] is a child of first[1 - i]
    first_hidden, second_hidden = (torch.randn(2, head.config.hidden, generator=g) for _ in range(2))
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.scored_step(prompt, features, cache)
        base = cache.length
        level = torch.full((2,), base)
        lm.scored_step(first, first_hidden, cache, 2, level, torch.eye(2, dtype=torch.bool))
        lineage = torch.tensor([[False, True, True, False], [True, False, False, True]])
        tree = lm.scored_step(second, second_hidden, cache, 2, level + 1, lineage)
        chains = []
        for node in range(2):
            cache.crop(base)
            parent = 1 - node
            ids, hidden = (
                torch.stack([first[parent], second[node]]),
                torch.stack([first_hidden[parent], second_hidden[node]]),
            )
            chains.append(lm.scored_step(ids, hidden, cache))
    for node in range(2):
        for got, want in zip(tree, chains[node], strict=True):
            torch.testing.assert_close(got[node : node + 1], want, rtol=1e-5, atol=1e-5)
    if which == "replayed":
        assert replayed(static_head) == {2}
