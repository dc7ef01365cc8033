"""specbench's fast forward (models/fast.py, --compile): transformers' arithmetic, the engine's cache
contract (test_tree_forward runs its cache tests on it too), the row plan it measures, and
exactness: speculative sampling through it still draws from the target's law."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specbench.decoding.sampling import Sampling
from specbench.decoding.tree import tree_inputs
from specbench.drafters.model import ModelDrafter
from specbench.models import fast
from specbench.models.fast import PLANNED_UP_TO, FastLlama, Rows, attend, fastest_ways, row_plan, unsupported
from specbench.models.lm import CacheView, HFCausalLM
from specbench.models.load import load

from ..families import FAMILIES, llama, qwen3
from ..helpers import LawLM, tiny_law_model
from ..toy import P_FLOOR, speculative_law_p

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load(tiny_pair[0], CPU, F32).model


def scores(lm: HFCausalLM, prefix: torch.Tensor, chain: torch.Tensor, parents: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill, a chain forward and a tree forward on top of it, with the shortlist on."""
    lm.reset()
    out = [lm.forward(prefix, last=2), lm.forward(chain, last=len(chain))]
    positions, mask = tree_inputs(parents, lm.length, CPU)
    out.append(lm.forward(chain[: len(parents)], last=len(parents), positions=positions, mask=mask))
    return out


@pytest.mark.parametrize("shortlisted", [False, True])
def test_the_own_forward_is_transformers_arithmetic(target, shortlisted):
    # With the modules' own weights the fast forward runs transformers' operations in transformers'
    # order: the logits are equal bit for bit, prefill, chain and tree alike.
    width = target.get_output_embeddings().weight.shape[0]
    head = torch.arange(0, width, 3) if shortlisted else None
    prefix, chain = torch.arange(5, 40), torch.tensor([7, 8, 9, 10])
    want = scores(HFCausalLM(target, width, head), prefix, chain, [-1, 0, 0])
    got = scores(HFCausalLM(target, width, head, FastLlama(target, packed=False)), prefix, chain, [-1, 0, 0])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("host_reads", [True, False], ids=["filled-rows", "all-rows"])
def test_a_packed_shortlisted_head_scores_the_ids_read_since_it_was_packed(target, monkeypatch, host_reads):
    # The packed head is a copy: each forward that read new ids must score them, whichever rows it scores.
    from specbench.models import lm as lm_module

    monkeypatch.setattr(lm_module, "host_reads_free", lambda device: host_reads)
    width = target.get_output_embeddings().weight.shape[0]
    head = torch.arange(0, width, 3)
    prefix, chain = torch.arange(5, 40), torch.tensor([41, 44, 47, 50])  # the chain's ids are new
    want = scores(HFCausalLM(target, width, head), prefix, chain, [-1, 0, 0])
    got = scores(HFCausalLM(target, width, head, FastLlama(target, packed=True, plan={})), prefix, chain, [-1, 0, 0])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(torch.isinf(g), torch.isinf(w))
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_packed_weights_move_the_logits_by_rounding_only(target):
    # Every way a plan may run a row count: packed, on the own weights beside the packed copy, padded.
    fast = FastLlama(target, packed=True)
    assert fast.route == "packed" and sorted(fast.plan) == list(range(1, PLANNED_UP_TO + 1))
    plans = [dict(fast.plan), {}] + [{n: Rows(PLANNED_UP_TO, packed) for n in fast.plan} for packed in (True, False)]
    assert_planned_scores_as_transformers(fast, target, [*plans, {n: Rows(n, False) for n in fast.plan}])


def test_a_plan_runs_each_row_count_on_the_weights_it_names(target, monkeypatch):
    # One row on the own weights, two packed and padded to three, the rest as they come: each product
    # reaches the kernel the plan names, with the rows it names, and gives back the rows asked for.
    fast = FastLlama(target, packed=True, plan={1: Rows(1, False), 2: Rows(3, True)})
    # The own weights are the modules' (joining them on a CPU would copy weights mapped from their file).
    assert not fast.joined and fast.head.weights[0].data_ptr() == target.lm_head.weight.data_ptr()
    calls, linear, packed = [], torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: calls.append(("own", len(x))) or linear(x, *a))
    monkeypatch.setattr(
        torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(("packed", len(x))) or packed(x, *a)
    )
    out = {n: fast.head(torch.zeros(n, target.config.hidden_size)).shape[0] for n in (1, 2, 4)}
    assert out == {1: 1, 2: 2, 4: 4} and calls == [("own", 1), ("packed", 3), ("packed", 4)]


def assert_planned_scores_as_transformers(fast: FastLlama, model, plans) -> None:
    """``fast``'s logits (a prefill, a chain, a tree) under each of ``plans`` are transformers' to
    rounding, with the same argmax."""
    width = model.get_output_embeddings().weight.shape[0]
    prefix, chain = torch.arange(5, 40), torch.tensor([7, 8, 9, 10])
    want = scores(HFCausalLM(model, width), prefix, chain, [-1, 0, 0])
    for plan in plans:
        fast.plan.clear()
        fast.plan.update(plan)
        got = scores(HFCausalLM(model, width, fast=fast), prefix, chain, [-1, 0, 0])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_compiled_forward_scores_as_the_own_one(request, family):
    # The CUDA route (torch.compile of the elementwise work, dynamic shapes) compiled here on CPU:
    # every forward size of a run goes through the same graphs, with transformers' scores; Qwen3's
    # per-head norms of queries and keys too.
    target = request.getfixturevalue("target") if family == "llama" else qwen3(0)
    width = target.get_output_embeddings().weight.shape[0]
    from torch._dynamo.utils import counters

    compiled = FastLlama(target, packed=False, compiled=True)
    assert compiled.route == "inductor"
    # Compiled and warmed while it was built: the forwards below, at every size, compile nothing more.
    frames = dict(counters["frames"])
    prefix, chain = torch.arange(5, 40), torch.tensor([7, 8, 9, 10])
    want = scores(HFCausalLM(target, width, fast=FastLlama(target, packed=False)), prefix, chain, [-1, 0, 0])
    got = scores(HFCausalLM(target, width, fast=compiled), prefix, chain, [-1, 0, 0])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert dict(counters["frames"]) == frames and frames.get("ok", 0) >= 3


def test_a_compiler_that_fails_leaves_the_eager_functions_and_one_log_line(target, monkeypatch, caplog):
    """torch.compile fails lazily, at a compiled function's first call (no Triton, no C compiler): that
    happens while the forward is built, which then runs eagerly, with transformers' logits."""

    def compile_without_a_compiler(function, **_):
        def fails(*args, **kwargs):
            raise RuntimeError("Cannot find a working triton installation\nmore detail")

        return fails

    monkeypatch.setattr(torch, "compile", compile_without_a_compiler)
    with caplog.at_level("WARNING", logger="specbench"):
        fast = FastLlama(target, packed=False, compiled=True)
    assert not fast.compiled and fast.route == "own"
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile failed, the fast path runs its elementwise work eagerly: Cannot find a working triton installation"
    ]
    width = target.get_output_embeddings().weight.shape[0]
    prefix, chain = torch.arange(5, 40), torch.tensor([7, 8, 9, 10])
    want = scores(HFCausalLM(target, width), prefix, chain, [-1, 0, 0])
    for g, w in zip(scores(HFCausalLM(target, width, fast=fast), prefix, chain, [-1, 0, 0]), want, strict=True):
        assert torch.equal(g, w)


def test_a_cache_view_reads_true_positions_on_the_fast_forward(target):
    # A view gives each token its position in the sequence itself (RoPE), through the fast forward too.
    width = target.get_output_embeddings().weight.shape[0]
    fast = FastLlama(target, packed=False)
    views = [CacheView(target, width, budget=64), CacheView(target, width, budget=64, fast=fast)]
    ids = torch.arange(3, 50)
    out = [(view.prefill(ids), view.forward(torch.tensor([5, 6]), last=2))[1] for view in views]
    assert torch.equal(out[0], out[1])


def test_another_way_is_chosen_only_when_it_clearly_pays():
    # The packed products of the 2-core AMD EPYC: one and two rows run fastest padded to four, but three
    # take within 10% of four's time, and are simpler.
    seconds = {1: 22.7, 2: 26.5, 3: 21.0, 4: 19.0, 5: 19.3, 6: 20.0, 7: 24.0, 8: 25.0}
    assert fastest_ways({Rows(n, True): t for n, t in seconds.items()}) == {n: Rows(max(n, 3), True) for n in seconds}
    # 2% is noise, not a reason to pad, nor to leave the packed copy; nor is 8%.
    assert fastest_ways({Rows(1, True): 10.0, Rows(2, True): 9.8, Rows(1, False): 9.2, Rows(2, False): 9.9}) == {
        1: Rows(1, True),
        2: Rows(2, True),
    }
    # Between two ways that both pay, the simpler stands unless the other clearly beats it too: the own
    # weights' two rows 3% faster than their one (noise, as the 2-core Xeon's varied) do not pad a row.
    assert fastest_ways({Rows(1, True): 41.3, Rows(1, False): 30.8, Rows(2, True): 39.0, Rows(2, False): 29.9})[
        1
    ] == Rows(1, False)
    # A 2-core Xeon's linears (ms): the own weights for one to three rows, packed from four.
    packed = {1: 41.3, 2: 39.1, 3: 39.6, 4: 40.1, 5: 39.7}
    own = {1: 29.8, 2: 31.3, 3: 34.5, 4: 52.9, 5: 52.6}
    ways = {Rows(n, True): t for n, t in packed.items()} | {Rows(n, False): t for n, t in own.items()}
    assert fastest_ways(ways) == {
        1: Rows(1, False),
        2: Rows(2, False),
        3: Rows(3, False),
        4: Rows(4, True),
        5: Rows(5, True),
    }
    # Without a packed copy (want of memory), as a count comes means on the own weights.
    assert fastest_ways({Rows(1, False): 10.0, Rows(2, False): 8.0}) == {1: Rows(2, False), 2: Rows(2, False)}


def test_a_model_left_unpacked_for_want_of_memory_still_runs_the_fastest_row_counts(monkeypatch):
    # A 7B in bfloat16 on a 24 GB CPU has no room for a packed copy; its own products still choose their
    # kernel by the row count (one row ran 12% slower than two on the AMD EPYC), so it measures them too.
    model = llama(0, layers=2, hidden=256)
    monkeypatch.setattr(fast, "available_memory", lambda: 10**6)  # bytes free: no packed copy fits
    own = FastLlama(model)
    assert own.route == "own" and sorted(own.plan) == list(range(1, PLANNED_UP_TO + 1))
    assert not any(how.packed for how in own.plan.values())
    assert_planned_scores_as_transformers(own, model, ({n: Rows(PLANNED_UP_TO, False) for n in own.plan}, {}))
    width = model.config.vocab_size
    rows, linear = [], torch.nn.functional.linear  # the padded rows reach the product, and only the asked come back
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *args: rows.append(len(x)) or linear(x, *args))
    own.plan.update({1: Rows(3, False)})
    assert own.head(torch.zeros(1, 256)).shape == (1, width) and rows == [3]
    # Asked to run unpacked (the static path, transformers' arithmetic bit for bit), it runs as it comes;
    # rebuilt over changed weights (online updates), it keeps the plan it measured.
    assert FastLlama(model, packed=False).plan == {}
    monkeypatch.setattr(fast, "row_plan", lambda *args, **kw: pytest.fail("measured again"))
    assert FastLlama(model, own.packed, own.compiled, {1: Rows(2, False)}).plan == {1: Rows(2, False)}


def test_the_row_counts_are_timed_over_the_first_layers_that_outweigh_a_cache(monkeypatch):
    # Products that outgrow PLAN_SAMPLE_BYTES are left out (a 7B's whole set would take half a
    # minute a way); the head is always timed.
    model = FastLlama(llama(0, layers=3, hidden=256), packed=False)
    layers = [m for layer in model.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    assert fast.plan_sample(layers, model.head) == [*layers, model.head]  # a tiny model: all of it
    monkeypatch.setattr(fast, "PLAN_SAMPLE_BYTES", layers[0].bytes + 1)
    assert fast.plan_sample(layers, model.head) == [*layers[:2], model.head]


def test_row_plan_measures_every_size_up_to_the_limit_both_ways(target, monkeypatch):
    fast_forward = FastLlama(target, packed=True)
    timed = []
    run = fast.Linear.run
    monkeypatch.setattr(fast.Linear, "run", lambda self, x, how: timed.append(how) or run(self, x, how))
    plan = row_plan([layer.qkv for layer in fast_forward.layers] + [fast_forward.head], F32, repeats=1)
    assert sorted(plan) == list(range(1, PLANNED_UP_TO + 1))
    assert all(n <= how.count <= PLANNED_UP_TO for n, how in plan.items())
    assert set(timed) == {Rows(n, packed) for n in range(1, PLANNED_UP_TO + 1) for packed in (True, False)}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_own_forward_is_transformers_arithmetic_in_every_family(family):
    # Mistral's decoder is Llama's, Qwen2's adds biases to q, k and v (random here), Qwen3's norms each
    # head's queries and keys; a Llama may have biases on every product (random here too).
    model = family(0)
    if family is llama:
        model = LlamaForCausalLM(LlamaConfig(**model.config.to_dict() | dict(attention_bias=True, mlp_bias=True)))
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("bias"):
                    weight.normal_(0.0, 0.5)
    assert unsupported(model) is None
    width = model.config.vocab_size
    prefix, chain = torch.arange(5, 40), torch.tensor([7, 8, 9, 10])
    want = scores(HFCausalLM(model, width), prefix, chain, [-1, 0, 0])
    got = scores(HFCausalLM(model, width, None, FastLlama(model, packed=False)), prefix, chain, [-1, 0, 0])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    packed = scores(HFCausalLM(model, width, None, FastLlama(model, packed=True, plan={})), prefix, chain, [-1, 0, 0])
    for g, w in zip(packed, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_joined_products_hold_the_weights_once_and_score_as_transformers(family):
    # CUDA's unpacked route runs q, k and v (gate and up) as one product over one weight, which the
    # modules' own parameters become views of: no second copy, and transformers' model, which still runs
    # its products one by one over those views, scores as before. Qwen2's random biases are joined too.
    model = family(0)
    width, attention = model.config.vocab_size, model.model.layers[0].self_attn
    before = sum(p.numel() for p in model.parameters())
    prefix, chain = torch.arange(5, 40), torch.tensor([7, 8, 9, 10])
    want = scores(HFCausalLM(model, width), prefix, chain, [-1, 0, 0])
    joined = FastLlama(model, packed=False, joined=True)
    assert joined.joined and not FastLlama(model, packed=False).joined  # not by default on a CPU
    qkv = joined.layers[0].qkv.weights
    assert len(qkv) == 1 and qkv[0].data_ptr() == attention.q_proj.weight.data_ptr()
    assert attention.v_proj.weight.data_ptr() == qkv[0][-attention.v_proj.weight.shape[0] :].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    got = scores(HFCausalLM(model, width, None, joined), prefix, chain, [-1, 0, 0])
    after = scores(HFCausalLM(model, width), prefix, chain, [-1, 0, 0])
    for g, a, w in zip(got, after, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)
    # Built again over the same model (online updates rebuild it), it joins the views without a copy.
    again = FastLlama(model, packed=False, joined=True)
    assert again.layers[0].qkv.weights[0].data_ptr() == qkv[0].data_ptr()
    assert again.layers[0].gate_up.weights[0].data_ptr() == joined.layers[0].gate_up.weights[0].data_ptr()


def test_models_beyond_the_fast_path_say_why(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert unsupported(gpt2) == "the fast path covers llama, mistral, qwen2 and qwen3 models, not gpt2"
    shape = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=50)
    windowed = MistralForCausalLM(MistralConfig(**shape, sliding_window=16))  # Mistral 7B v0.1's kind
    assert unsupported(windowed) == "the fast path covers full attention in every layer, not sliding windows"
    # transformers' Mistral slides every layer whenever it has a window, whatever layer_types says
    windowed.config.layer_types = ["full_attention"]
    assert unsupported(windowed) == "the fast path covers full attention in every layer, not sliding windows"
    gelu = LlamaForCausalLM(LlamaConfig(**shape, hidden_act="gelu"))
    assert unsupported(gelu) == "the fast path covers models with SiLU, not gelu"


# ---------------------------------------------------------------- exactness through the fast forward


def sampled_law_p(target: LawLM, draft: LawLM, k: int, negative_control: bool = False) -> float:
    device = target.device
    cfg, generator = Sampling(temperature=1.0), torch.Generator(device=device).manual_seed(0)
    drafter = ModelDrafter(draft, cfg, generator)
    return speculative_law_p(target, drafter, k, cfg, generator, negative_control=negative_control)


# The fast forward's routes: oneDNN-packed weights on the CPU, inductor on CUDA (compiled at build, in
# float32 here). make gpu-check runs the cuda ones. The modules' own weights (the CPU's other route) have
# no law test of their own: that route's logits are transformers' bit for bit
# (test_the_own_forward_is_transformers_arithmetic), and its cache is the packed route's.
ROUTES = [
    pytest.param("cpu", True, id="packed", marks=pytest.mark.slow),
    pytest.param("cuda", False, id="cuda", marks=pytest.mark.gpu),
]


def law_pair(tmp_path, device: str, packed: bool) -> tuple[LawLM, LawLM]:
    pair = LawLM(tiny_law_model(1, tmp_path, device), packed), LawLM(tiny_law_model(2, tmp_path, device), packed)
    assert {lm.fast.route for lm in pair} == {"inductor" if device == "cuda" else "packed" if packed else "own"}
    return pair


@pytest.mark.parametrize("device,packed", ROUTES)
def test_speculative_sampling_on_the_fast_forward_matches_the_target_law(tmp_path, one_thread, device, packed):
    assert sampled_law_p(*law_pair(tmp_path, device, packed), k=2) > P_FLOOR


@pytest.mark.parametrize("device,packed", ROUTES)
def test_the_test_catches_a_fast_forward_that_misplaces_its_rows(tmp_path, one_thread, monkeypatch, device, packed):
    # A verification forward whose rows come back one place off: each drafted token is judged by the
    # distribution of the position before it. One-token forwards are unaffected. Up to as many
    # samples as the exact test draws (drawn_p's last look): with a third of them, on CUDA, the
    # broken law scored p = 0.002; packed on the CPU, a quarter scored 9e-6.
    target, draft = law_pair(tmp_path, device, packed)
    hidden = FastLlama.hidden
    monkeypatch.setattr(FastLlama, "hidden", lambda self, *args, **kw: hidden(self, *args, **kw).roll(1, 0))
    assert sampled_law_p(target, draft, k=2, negative_control=True) < P_FLOOR


def test_folded_query_groups_attend_as_grouped_heads():
    """CUDA's route for a masked grouped-query forward (each key/value head's queries folded into one
    sequence, no enable_gqa: the memory-efficient kernel) and the CPU's (grouped in the kernel) attend
    as the key/value heads repeated would: additive and boolean masks, with and without their leading
    dimensions, a batch of rows (distill's training-time test), and no mask."""
    torch.manual_seed(0)
    q, keys, values = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    allowed = torch.rand(5, 12) > 0.3
    allowed[:, 0] = True  # every query attends to something
    additive = torch.zeros(5, 12).masked_fill(~allowed, float("-inf"))
    repeated = keys.repeat_interleave(4, dim=1), values.repeat_interleave(4, dim=1)
    for mask in (additive[None, None], additive, allowed, None):
        want = torch.nn.functional.scaled_dot_product_attention(q, *repeated, attn_mask=mask)
        torch.testing.assert_close(attend(q, keys, values, mask, grouped=False), want)
        torch.testing.assert_close(attend(q, keys, values, mask, grouped=True), want)
    # Which key/value head a query head reads shows: the two swapped, every route differs from the law.
    want = torch.nn.functional.scaled_dot_product_attention(q, *repeated, attn_mask=additive)
    for grouped in (False, True):
        assert not torch.allclose(attend(q, keys.flip(1), values.flip(1), additive, grouped=grouped), want)
    with pytest.raises(ValueError, match="per head"):
        attend(q, keys, values, additive.expand(1, 8, 5, 12), grouped=False)


def test_folded_query_groups_take_the_memory_efficient_kernels_layout(monkeypatch):
    """On CUDA a masked attention runs the memory-efficient kernel, whose output [b, h, n, d] is laid
    out as [b, n, h, d] transposed; a CPU's is contiguous. Folded groups read back from that layout
    attend as grouped heads still (a view of it raised on CUDA, for one token and for several)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_out(*args, **kw):
        return sdpa(*args, **kw).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(fast.F, "scaled_dot_product_attention", transposed_out)
    torch.manual_seed(0)
    for n in (1, 5):
        q, keys, values = torch.randn(1, 8, n, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
        mask = torch.ones(n, 12, dtype=torch.bool).tril(12 - n)
        want = sdpa(q, keys.repeat_interleave(4, dim=1), values.repeat_interleave(4, dim=1), attn_mask=mask)
        torch.testing.assert_close(attend(q, keys, values, mask, grouped=False), want)


@pytest.mark.gpu
def test_on_cuda_the_forward_is_compiled_at_build_and_scores_as_eager(tiny_pair):
    """CUDA's default route: inductor, compiled and warmed while it is built, in bfloat16; its logits
    within bfloat16's rounding of the eager model's, and its argmax the same."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    model = load(tiny_pair[0], cuda, torch.bfloat16).model
    fast = FastLlama(model)
    assert fast.route == "inductor" and fast.build_seconds > 0
    frames = dict(counters["frames"])
    width = model.get_output_embeddings().weight.shape[0]
    prefix, chain = torch.arange(5, 40, device=cuda), torch.tensor([7, 8, 9, 10], device=cuda)
    lm = HFCausalLM(model, width, fast=fast)
    lm.reset()
    got = [lm.forward(prefix, last=2), lm.forward(chain, last=len(chain))]
    eager = HFCausalLM(model, width)
    eager.reset()
    want = [eager.forward(prefix, last=2), eager.forward(chain, last=len(chain))]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=0.05, atol=0.1)
    assert dict(counters["frames"]) == frames  # nothing compiled after the build


def test_a_run_without_compile_given_gets_the_own_forward_on_a_cpu_and_eager_on_cuda(tiny_pair):
    from specbench.models.load import Wanted
    from specbench.models.pair import default_compile, load_pair

    assert default_compile(torch.device("cpu")) and not default_compile(torch.device("cuda", 1))
    pair = load_pair(Wanted(*tiny_pair, device="cpu"))
    assert pair.target_lm.fast is not None and pair.draft_lm.fast is not None
    assert load_pair(Wanted(*tiny_pair, device="cpu"), compile=False).target_lm.fast is None
