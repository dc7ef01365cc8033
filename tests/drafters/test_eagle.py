"""EAGLE drafting (models/eagle_head.py): the published EAGLE-3 head format, and exactness: chains, fixed trees
and EAGLE-2's dynamic trees drawn from a head give the target's law, each with a broken variant
that fails the same test, and greedy outputs equal the baseline's."""

import copy
import dataclasses
import json
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.decoding.decode import autoregressive_decode, heuristic_k, speculative_decode
from specbench.decoding.sampling import Sampling, warp
from specbench.drafters import propose
from specbench.drafters.eagle import EagleDrafter
from specbench.models.eagle_head import WEIGHTS, load_head, read_head, save_head
from specbench.models.fast import PLANNED_UP_TO, Rows
from specbench.models.load import load

from ..helpers import LawLM, build_eagle3_head, cli_on_tiny_pair, one_line_error, tiny_law_model
from ..toy import P_FLOOR, SAMPLES, speculative_law_p
from .test_lookup_or_draft import CountedRounds, LookupTokensWithModelRows

CPU, F32 = torch.device("cpu"), torch.float32
DRAFT_IDS = [0, 2]  # of the law model's 3: q is zero at id 1, which the head never drafts
LAW_TAPS = (0, 1, 2)  # the law head reads the target's input layers 0 and 1 and its final states


@pytest.fixture(scope="module")
def law(tmp_path_factory):
    """A tiny Llama target whose exact law is known, and a head reading its input layers 0 and 1 and
    its final states, over a reduced vocabulary."""
    tmp = tmp_path_factory.mktemp("law")
    target = LawLM(tiny_law_model(1, tmp), packed=True)
    path = build_eagle3_head(tmp / "head", target.model.config, taps=LAW_TAPS, draft_ids=DRAFT_IDS, seed=3)
    return target, head_for(target, path)


def head_for(target, path):
    config = target.model.config
    embed = target.model.get_input_embeddings().weight
    return read_head(path, embed, config.num_hidden_layers, config.hidden_size, config.vocab_size)


def sampled_p(target, drafter_of, k: int = 2, schedule=None, negative_control: bool = False) -> float:
    cfg, generator = Sampling(temperature=1.0), torch.Generator().manual_seed(0)
    drafter = drafter_of(cfg, generator)
    target.record_features(LAW_TAPS)
    return speculative_law_p(target, drafter, k, cfg, generator, schedule, negative_control=negative_control)


SHAPES = {"chain": {}, "tree": {"shape": (2, 1)}, "dynamic": {"dynamic": (3, 2)}}
# The lookahead policies a chain takes: the head's confidence stop (p_min), transformers' schedule.
POLICIES = {"confidence": ({"p_min": 0.6}, None), "heuristic": ({}, heuristic_k)}


# ---------------------------------------------------------------- the published format


def test_a_published_head_loads_with_its_mapping_and_layers(law):
    _, head = law
    assert head.draft_ids.tolist() == DRAFT_IDS
    assert head.config.taps == (0, 1, 2) and head.config.fused and head.config.draft_vocab == 2


def every_score(head, ids: torch.Tensor) -> torch.Tensor:
    """The head's scores after each of ``ids`` [n, draft_vocab], read as a chain from an empty cache
    (each with a zero feature)."""
    hidden = head.embed.new_zeros(len(ids), head.config.hidden)
    return head.draft_logits(head.step(ids, hidden, torch.arange(len(ids)), head.new_cache()))


def test_a_saved_head_reads_back_as_the_same_head(law, tmp_path):
    target, head = law
    save_head(head, tmp_path / "saved", target_layers=2)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 2
    again = head_for(target, tmp_path / "saved")
    ids = torch.tensor([0, 2, 1])
    with torch.inference_mode():
        a, b = every_score(head, ids), every_score(again, ids)
    assert again.draft_ids.tolist() == DRAFT_IDS
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # saved in half precision


def in_speculators_layout(path: Path, **changes) -> Path:
    """The head at ``path`` (build_eagle3_head's, ``layers.0.*`` weights) with its config.json rewritten
    as the speculators library writes one: the layer's fields in transformer_layer_config (its norm's
    epsilon, LlamaConfig's default, left out as to_diff_dict leaves it), the head's own beside it;
    ``changes`` set fields of the top level (those it has, and EAGLE-3.1's norms) or of the layer."""
    config = json.loads((path / "config.json").read_text())
    eagle = config.pop("eagle_config")
    head = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": config.pop("draft_vocab_size"),
        "norm_before_residual": True,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}]},
    }
    del config["architectures"]
    del config["rms_norm_eps"]  # LlamaConfig's default (1e-6 the caller wrote): to_diff_dict leaves it out
    head["transformer_layer_config"] = config
    for name, value in changes.items():
        (head if name in head or name in ("norm_before_fc", "norm_output", "fc_norm") else config)[name] = value
    (path / "config.json").write_text(json.dumps(head))
    return path


def test_a_head_in_the_speculators_layout_reads_as_the_same_head(law, tmp_path):
    # RedHatAI's published heads (vLLM's speculators library): the same weights under another config.
    target, _ = law
    config = target.model.config
    path = build_eagle3_head(
        tmp_path / "h", config, taps=LAW_TAPS, draft_ids=DRAFT_IDS, seed=5, layer_prefix="layers.0"
    )
    plain = json.loads((path / "config.json").read_text())
    plain["rms_norm_eps"], plain["norm_before_residual"], plain["max_position_embeddings"] = 1e-6, True, 4096
    (path / "config.json").write_text(json.dumps(plain))
    want = head_for(target, path)
    got = head_for(target, in_speculators_layout(path))
    assert got.config == want.config and got.config.eps == 1e-6 and got.config.norm_before_residual
    assert got.draft_ids.tolist() == DRAFT_IDS
    ids = torch.tensor([0, 2, 1, 2])
    with torch.inference_mode():
        assert torch.equal(every_score(got, ids), every_score(want, ids))


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"model_type": "qwen3"}, "the head has qwen3 layers; specbench runs EAGLE-3 heads of one Llama layer"),
        ({"attention_bias": True}, "the head has biases;"),
        ({"norm_before_fc": True}, "the head has a norm before fc;"),
        ({"norm_output": True, "fc_norm": True}, "the head has a norm after fc and a norm on its output;"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "its transformer_layer_config does not read as"),
        ({"speculators_model_type": "eagle"}, "a speculators 'eagle' model, not an EAGLE-3 head"),
    ],
)
def test_a_speculators_head_specbench_cannot_run_is_refused_in_one_line(law, tmp_path, changes, needle):
    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, seed=5, layer_prefix="layers.0")
    with pytest.raises(SpecbenchError, match=re.escape(needle)):
        head_for(target, in_speculators_layout(path, **changes))


def test_a_head_is_as_deep_as_its_weights_say(law, tmp_path):
    # A speculators config may give the verifier's layer count (vLLM's users override it to 1): the
    # weights decide. A second layer's weights are refused in one line.
    from safetensors.torch import load_file, save_file

    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, draft_ids=DRAFT_IDS, seed=3)
    want = head_for(target, path)
    one = head_for(target, in_speculators_layout(path, num_hidden_layers=28, norm_before_residual=False))
    assert one.config == dataclasses.replace(want.config, eps=1e-6, max_positions=2048)  # LlamaConfig's defaults
    weights = load_file(path / WEIGHTS)
    weights |= {name.replace("midlayer.", "layers.1."): w.clone() for name, w in weights.items() if "midlayer." in name}
    save_file({name.replace("midlayer.", "layers.0."): w for name, w in weights.items()}, str(path / WEIGHTS))
    with pytest.raises(SpecbenchError, match="the head has 2 decoder layers; specbench runs EAGLE-3 heads of one$"):
        head_for(target, path)


def test_a_speculators_head_without_its_norm_field_runs_as_in_vllm(law, tmp_path):
    # The library always writes norm_before_residual; vLLM reads a config without it as True.
    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, seed=5, layer_prefix="layers.0")
    config = json.loads((in_speculators_layout(path) / "config.json").read_text())
    del config["norm_before_residual"]
    (path / "config.json").write_text(json.dumps(config))
    assert head_for(target, path).config.norm_before_residual


@pytest.mark.parametrize(
    "eagle, needle",
    [
        ({"norm_before_fc": True}, "the head has a norm before fc; specbench runs EAGLE-3 heads of one Llama layer"),
        ({}, "its RoPE parameters do not read as a Llama's"),
    ],
    ids=["norm-before-fc", "llama3-without-its-factors"],
)
def test_an_eagle3_head_specbench_cannot_run_is_refused_in_one_line(law, tmp_path, eagle, needle):
    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, seed=5)
    config = json.loads((path / "config.json").read_text())
    config["eagle_config"] |= eagle
    if not eagle:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}  # no low and high frequency factors
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecbenchError, match=re.escape(needle)) as raised:
        head_for(target, path)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("damage", ["not tensors", "cut short"])
def test_weights_that_cannot_be_read_are_one_line(law, tmp_path, damage):
    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, seed=5)
    if damage == "not tensors":  # a pickle weights_only refuses (it could run code)
        (path / WEIGHTS).unlink()
        torch.save({"weights": Fraction(1, 3)}, path / "pytorch_model.bin")
    else:
        (path / WEIGHTS).write_bytes((path / WEIGHTS).read_bytes()[:5000])
    with pytest.raises(SpecbenchError, match="cannot read the weights file") as raised:
        head_for(target, path)
    assert "\n" not in str(raised.value)


def test_a_head_in_pytorchs_format_reads_as_the_same_head(law, tmp_path):
    # EAGLE-3's authors publish their heads as pytorch_model.bin.
    from safetensors.torch import load_file

    target, head = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, draft_ids=DRAFT_IDS, seed=3)
    torch.save(load_file(path / WEIGHTS), path / "pytorch_model.bin")
    (path / WEIGHTS).unlink()
    ids = torch.tensor([0, 2, 1, 2])
    with torch.inference_mode():
        assert torch.equal(every_score(head_for(target, path), ids), every_score(head, ids))


def test_a_head_named_by_its_hub_id_is_read_from_the_hub_cache(law, tmp_path, monkeypatch):
    # --speculator RedHatAI/Qwen3-8B-speculator.eagle3, as --target takes a hub id: the cached snapshot,
    # else a download of its config and weights only; offline and uncached, one line.
    import huggingface_hub
    from huggingface_hub import errors

    from specbench.models.names import speculator_dir

    target, _ = law
    path = build_eagle3_head(tmp_path / "snapshot", target.model.config, taps=LAW_TAPS, draft_ids=DRAFT_IDS, seed=3)
    asked = []

    def snapshot_download(repo_id, local_files_only=False, allow_patterns=None):
        asked.append((repo_id, local_files_only, allow_patterns))
        if repo_id == "org/cached-head" or not local_files_only:
            return str(path)
        raise errors.LocalEntryNotFoundError(f"{repo_id} is not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert speculator_dir("org/cached-head") == path and asked == [("org/cached-head", True, None)]
    monkeypatch.setattr("specbench.core.environment.hub_reachable", lambda: True)
    assert speculator_dir("org/new-head") == path
    assert asked[-1] == ("org/new-head", False, ["*.json", "*.safetensors", "pytorch_model.bin"])  # the head's only
    monkeypatch.setattr("specbench.core.environment.hub_reachable", lambda: False)
    with pytest.raises(SpecbenchError) as raised:
        speculator_dir("org/offline-head")
    said = str(raised.value)
    assert said.startswith("model org/offline-head is not in the local Hugging Face cache and the hub is unreachable")
    assert "\n" not in said and "--random-weights" not in said


def test_a_packed_or_joined_head_scores_as_the_modules_own(law, tmp_path):
    target, _ = law
    path = build_eagle3_head(tmp_path / "head", target.model.config, taps=(0, 1, 2), draft_ids=DRAFT_IDS, seed=4)
    plain, packed, joined = head_for(target, path), head_for(target, path), head_for(target, path)
    packed.pack()
    joined.join()  # CUDA's: q, k and v one product over one weight, the modules' parameters views of it
    attention = joined.midlayer.self_attn
    assert joined.products["qkv"].weights[0].data_ptr() == attention.q_proj.weight.data_ptr()
    assert joined.products["lm_head"].weights[0].data_ptr() == joined.lm_head.weight.data_ptr()  # no copy
    ids, features = torch.tensor([0, 2, 1, 1]), torch.randn(4, 96)
    with torch.inference_mode():
        a, b, c = every_score(plain, ids), every_score(packed, ids), every_score(joined, ids)
        fused = plain.fuse(features), packed.fuse(features)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(*fused, atol=1e-4, rtol=1e-4)
    assert torch.equal(a, c)
    # The packed head's plan (measured at pack, shared by its products) may run a count either way.
    plan = packed.products["qkv"].plan
    assert plan is packed.products["lm_head"].plan and sorted(plan) == list(range(1, PLANNED_UP_TO + 1))
    for way in (True, False):
        plan.update({n: Rows(n, way) for n in plan})
        with torch.inference_mode():
            torch.testing.assert_close(every_score(packed, ids), a, atol=1e-4, rtol=1e-4)


def test_default_layers_and_an_eagle1_head(tmp_path, tiny_pair):
    target = load(tiny_pair[0], CPU, F32).model
    default = head_for_model(target, build_eagle3_head(tmp_path / "h3", target.config, seed=0))
    assert default.config.taps == (2, 2, 1)  # vLLM's: 2, L/2, L-3 of the 4-layer target
    eagle1 = head_for_model(target, build_eagle3_head(tmp_path / "h1", target.config, taps=(), seed=0))
    assert eagle1.config.taps == (4,) and eagle1.fc is None  # the final normed states


def test_a_head_cast_to_bfloat16_keeps_its_rotary_frequencies_in_float32(tiny_pair, tmp_path):
    """load_head casts the head to the target's dtype; the RoPE frequencies must not follow. In bfloat16
    a frequency is off by up to 2^-9 of itself: at position 4,000 the angle by whole radians."""
    fp32 = load(tiny_pair[0], CPU, F32).model
    bf16 = load(tiny_pair[0], CPU, torch.bfloat16).model
    path = build_eagle3_head(tmp_path / "head", fp32.config, seed=0)
    exact, cast = load_head(path, fp32, pack=False), load_head(path, bf16, pack=False)
    assert cast.lm_head.weight.dtype == torch.bfloat16
    assert cast.inv_freq.dtype == F32 and torch.equal(cast.inv_freq, exact.inv_freq)
    assert (
        copy.deepcopy(exact).to(torch.bfloat16).inv_freq.dtype == F32
        and copy.deepcopy(exact).half().inv_freq.dtype == F32
    )
    position = torch.tensor([4000])
    for want, got in zip(exact._rotary(position), cast._rotary(position), strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want.to(torch.bfloat16))  # the same angles, rounded only at the end


# Each case: the RoPE's parameters beside its type and theta, and the file's other fields.
SCALED_ROPE = {
    "llama3": (
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"max_position_embeddings": 512},
    ),
    "yarn": ({"factor": 4.0, "original_max_position_embeddings": 64}, {"max_position_embeddings": 512}),
    "yarn-defaults": ({"factor": 4.0}, {}),  # its lengths are LlamaConfig's defaults, as vLLM reads them
    "linear": ({"factor": 2.0}, {"max_position_embeddings": 512}),
}


@pytest.mark.parametrize("case", SCALED_ROPE)
def test_a_head_with_scaled_rope_rotates_as_transformers_and_saves_it(law, tmp_path, case):
    # Llama 3.1's heads (llama3), long-context ones (yarn, whose cos and sin are scaled too): the
    # frequencies are those of transformers' rotary embedding built from the same file, and a saved
    # head keeps them, in the form vLLM builds its LlamaConfig from.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, seed=5)
    config = json.loads((path / "config.json").read_text())
    extra, fields = SCALED_ROPE[case]
    config.pop("rope_theta")
    config |= {"rope_parameters": {"rope_type": case.split("-")[0], "rope_theta": 500000.0, **extra}, **fields}
    (path / "config.json").write_text(json.dumps(config))
    head = head_for(target, path)
    shape = LlamaConfig(**copy.deepcopy(config))  # what vLLM and SGLang build from the file
    positions = torch.tensor([0, 5, 63, 64, 300, 511])
    want = LlamaRotaryEmbedding(shape)(torch.zeros(1, dtype=F32), positions[None])
    for got, expected in zip(head._rotary(positions), want, strict=True):
        torch.testing.assert_close(got[0, 0], expected[0], rtol=1e-6, atol=1e-6)
    save_head(head, tmp_path / "saved", target_layers=2)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert head_for(target, tmp_path / "saved").config == head.config
    assert LlamaConfig(**saved).rope_parameters == shape.rope_parameters


def test_a_head_with_rope_that_changes_with_length_is_refused_in_one_line(law, tmp_path):
    target, _ = law
    path = build_eagle3_head(tmp_path / "h", target.model.config, taps=LAW_TAPS, seed=5)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}  # the oldest spelling
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        SpecbenchError, match="RoPE of type dynamic; EAGLE heads here take default, linear, llama3, yarn"
    ):
        head_for(target, path)


def head_for_model(model, path):
    config = model.config
    return read_head(
        path, model.get_input_embeddings().weight, config.num_hidden_layers, config.hidden_size, config.vocab_size
    )


# ---------------------------------------------------------------- exactness


@pytest.mark.slow
@pytest.mark.parametrize("how", SHAPES)
def test_eagle_drafts_give_the_target_law(law, one_thread, how):
    target, head = law
    assert sampled_p(target, lambda cfg, g: EagleDrafter(head, target, 3, cfg, g, **SHAPES[how])) > P_FLOOR


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_eagle_chains_with_a_lookahead_per_round_give_the_target_law(law, one_thread, policy):
    target, head = law
    options, schedule = POLICIES[policy]
    drafter_of = lambda cfg, g: EagleDrafter(head, target, 3, cfg, g, **options)  # noqa: E731
    assert sampled_p(target, drafter_of, k=3, schedule=schedule) > P_FLOOR


@pytest.mark.slow
def test_the_test_catches_q_rows_left_in_draft_ids(law, one_thread, monkeypatch):
    # The rows over the draft vocabulary placed at ids 0..1 rather than mapped through d2t: the
    # tokens are mapped, q is not.
    target, head = law

    def unmapped(self, q):
        rows = q.new_zeros(len(q), self.width)
        rows[:, : q.shape[1]] = q
        return rows

    monkeypatch.setattr(EagleDrafter, "_full", unmapped)
    assert sampled_p(target, lambda cfg, g: EagleDrafter(head, target, 3, cfg, g), negative_control=True) < P_FLOOR


@pytest.mark.slow
def test_the_test_catches_a_tree_of_distinct_children(law, one_thread, monkeypatch):
    # Children drawn without replacement (distinct, as if that drafted more), judged as independent draws.
    target, head = law

    def distinct(q, generator):  # a tree level's b draws per row ([n, b, V]), made without replacement
        b = q.shape[1]
        return torch.multinomial(q[:, 0], b, generator=generator).unsqueeze(-1)

    monkeypatch.setattr(propose, "sample", distinct)  # tree_level draws each level with it
    assert (
        sampled_p(target, lambda cfg, g: EagleDrafter(head, target, 3, cfg, g, shape=(2, 1)), negative_control=True)
        < P_FLOOR
    )


class SampledLooking(EagleDrafter):
    """A dynamic tree judged as if its top candidates had been drawn from the draft's distribution."""

    def _dynamic(self, out, logits, depth):
        draft = super()._dynamic(out, logits, depth)
        q = self._full(warp(self.head.draft_logits(out), self.sampling)).expand(len(draft.tokens), -1)
        return dataclasses.replace(draft, q=q)


@pytest.mark.slow
def test_the_test_catches_a_dynamic_tree_judged_as_sampled(law, one_thread):
    target, head = law
    assert (
        sampled_p(target, lambda cfg, g: SampledLooking(head, target, 3, cfg, g, dynamic=(3, 2)), negative_control=True)
        < P_FLOOR
    )


def test_eagle_chain_gives_the_target_law_quickly(law, one_thread):
    """The fast set's check: a third of the samples, chains only (the slow tests cover the rest)."""
    target, head = law
    cfg, generator = Sampling(temperature=1.0), torch.Generator().manual_seed(1)
    drafter = EagleDrafter(head, target, 3, cfg, generator)
    target.record_features(head.config.taps)
    assert speculative_law_p(target, drafter, 3, cfg, generator, samples=SAMPLES // 3) > P_FLOOR


@pytest.mark.parametrize("how", [*SHAPES, *POLICIES])
def test_greedy_eagle_equals_the_greedy_target(law, how, tmp_path):
    target, _ = law
    cfg, generator = Sampling(), torch.Generator()
    options, schedule = POLICIES[how] if how in POLICIES else (SHAPES[how], None)
    accepted = 0
    for seed in range(6):  # heads of several seeds, so that some drafts are accepted and some rejected
        path = build_eagle3_head(tmp_path / f"g{seed}", target.model.config, (0, 1, 2), DRAFT_IDS, seed=seed, scale=1.0)
        head = head_for(target, path)
        target.record_features(head.config.taps)
        for prompt in ([0, 2], [1, 1, 0], [2]):
            ids = torch.tensor(prompt)
            base = autoregressive_decode(target, ids, 12, cfg, generator).tokens
            drafter = EagleDrafter(head, target, 3, cfg, generator, **options)
            result = speculative_decode(target, drafter, ids, 3, 12, cfg, generator, schedule=schedule)
            assert result.tokens == base
            accepted += result.accepted
    assert accepted > 0


# ---------------------------------------------------------------- lookup-or-eagle


class ReadChecked(EagleDrafter):
    """An EagleDrafter that checks, at each forward that reads what is pending, that the head then
    holds one pair for every position the target holds: lookup's rounds read too, none twice."""

    def _read_pending(self):
        out = super()._read_pending()
        assert self.cache.length == self.target.length
        return out


def lookup_or_eagle(head, target, cfg, generator, kind=CountedRounds, **shape):
    return kind(ReadChecked(head, target, 3, cfg, generator, **shape), lookup_k=3, shortest=1)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["chain", "dynamic"])
def test_lookup_or_eagle_gives_the_target_law(law, one_thread, how):
    target, head = law
    drafters = []

    def drafter_of(cfg, g):
        drafters.append(lookup_or_eagle(head, target, cfg, g, **SHAPES[how]))
        return drafters[-1]

    assert sampled_p(target, drafter_of) > P_FLOOR
    assert drafters[0].rounds["lookup"] > 1000 and drafters[0].rounds["model"] > 1000  # both kinds of round ran


@pytest.mark.slow
def test_the_test_catches_lookup_tokens_passed_up_with_the_heads_rows(law, one_thread):
    target, head = law
    drafters = []

    def drafter_of(cfg, g):
        drafters.append(lookup_or_eagle(head, target, cfg, g, LookupTokensWithModelRows))
        return drafters[-1]

    assert sampled_p(target, drafter_of, negative_control=True) < P_FLOOR
    assert drafters[0].rounds["lookup"] > 1000


@pytest.mark.parametrize("how", ["chain", "dynamic"])
def test_greedy_lookup_or_eagle_equals_the_greedy_target(law, how, tmp_path):
    target, _ = law
    cfg, generator = Sampling(), torch.Generator()
    rounds = Counter()
    for seed in range(4):
        path = build_eagle3_head(tmp_path / f"g{seed}", target.model.config, (0, 1, 2), DRAFT_IDS, seed=seed, scale=1.0)
        head = head_for(target, path)
        target.record_features(head.config.taps)
        for prompt in ([0, 2, 0, 2], [1, 1, 0], [2]):
            ids = torch.tensor(prompt)
            base = autoregressive_decode(target, ids, 16, cfg, generator).tokens
            drafter = lookup_or_eagle(head, target, cfg, generator, **SHAPES[how])
            assert speculative_decode(target, drafter, ids, 3, 16, cfg, generator).tokens == base
            rounds += drafter.rounds
    assert rounds["lookup"] > 0 and rounds["model"] > 0


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_head(tiny_pair, tmp_path_factory):
    target = load(tiny_pair[0], CPU, F32).model
    return str(build_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", target.config, seed=5, scale=1.0))


def test_eagle_methods_run_end_to_end_on_a_published_head(tiny_pair, tiny_head, tmp_path):
    out = tmp_path / "run"
    result = cli_on_tiny_pair(
        "run",
        tiny_pair,
        "--method", "eagle,eagle-tree,eagle-dynamic,lookup-or-eagle", "--speculator", tiny_head, "--k", "2", "--tree", "2,1",
        "--num-prompts", "2", "--max-new-tokens", "12", "--repeats", "1", "--warmup", "0", "--cost-repeats", "2",
        "--dataset", "humaneval", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    import pandas as pd

    summary = pd.read_csv(out / "summary.csv")
    eagle = summary[summary["method"].str.startswith("eagle")]
    assert set(eagle["method"]) == {"eagle", "eagle-tree", "eagle-dynamic"}
    assert summary.set_index("method").loc["lookup-or-eagle", "outputs_match"] == 2
    assert (eagle["outputs_match"] == 2).all()  # greedy: each prompt's output is the baseline's
    assert (eagle["c"] > 0).all() and (eagle["draft_forwards"] > 0).all()
    costs = pd.read_csv(out / "verify_cost.csv")
    assert "eagle" in set(costs["model"])


def test_a_head_for_another_target_is_refused_in_one_line(tiny_pair, tmp_path, law):
    target, _ = law  # a 32-wide, 3-token target's head, for the 64-wide tiny target
    head = build_eagle3_head(tmp_path / "other", target.model.config, seed=0)
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--method", "eagle", "--speculator", str(head), "--out", str(tmp_path / "r")
    )
    one_line_error(result, "drafts for another target")


def test_eagle_needs_a_speculator(tiny_pair, tmp_path):
    result = cli_on_tiny_pair("run", tiny_pair, "--method", "eagle", "--out", str(tmp_path / "r"))
    one_line_error(result, "--method eagle needs --speculator PATH")


def test_a_speculator_that_is_not_a_head_is_refused_in_one_line(tiny_pair, tmp_path):
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--method", "eagle", "--speculator", tiny_pair[1], "--out", str(tmp_path / "r")
    )
    one_line_error(result, "not an EAGLE-3 head")


def test_the_default_target_brings_its_shipped_head():
    """smollm2-135m's --speculator defaults to the head specbench ships, which reads back as a head for
    that target's shape (the architecture's config, without its weights)."""
    from safetensors import safe_open

    from specbench.bench.config import BenchConfig
    from specbench.core.environment import config_dir
    from specbench.core.errors import SpecbenchError
    from specbench.models.load import speculator_dir

    cfg = BenchConfig(methods=["eagle"], target="smollm2-135m")
    cfg.validate()
    assert cfg.speculator == "smollm2-135m-eagle"
    arch = json.loads((config_dir() / "architectures" / "smollm2-135m.json").read_text())
    embed = torch.zeros(arch["vocab_size"], arch["hidden_size"])
    path = speculator_dir(cfg.speculator)
    head = read_head(path, embed, arch["num_hidden_layers"], arch["hidden_size"], arch["vocab_size"])
    assert head.config.taps == (2, 15, 27) and head.config.norm_before_residual
    with safe_open(path / WEIGHTS, "pt") as weights:  # half precision
        assert {weights.get_tensor(name).dtype for name in weights.keys() if name != "d2t"} == {torch.float16}
    with pytest.raises(SpecbenchError, match="no such directory"):
        speculator_dir("no-such-head")


def test_the_caches_make_room_for_a_dynamic_trees_widest_round():
    """A dynamic tree verifies --dynamic-nodes tokens, and its head's cache holds --dynamic-width nodes of
    each level but the last: both may pass K. The static caches are reserved for the widest round."""
    from specbench.bench.config import BenchConfig

    def widest(method, k, **options):
        return BenchConfig(methods=[method], ks=[k], speculator="smollm2-135m-eagle", **options).widest

    assert widest("eagle", 2) == 3
    assert widest("eagle-dynamic", 2, dynamic_nodes=5) == 6
    assert widest("eagle-dynamic", 4, dynamic_nodes=3, dynamic_width=3) == 10
    assert widest("lookup-or-eagle", 2, dynamic_nodes=5, lookup_k=8) == 9
