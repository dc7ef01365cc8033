"""Forward costs without checkpoints (--random-weights, --assume-alpha, theory --costs) and
--device-map, end to end on tiny configs."""

import csv
import json
import math
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from specbench.bench.config import BenchConfig
from specbench.bench.run import prepare
from specbench.core.errors import SpecbenchError
from specbench.models.load import (
    Wanted,
    length_tokenizer,
    offload_warning,
    random_model,
    random_weights_dtype,
    shared_width,
    skeleton,
    weight_bytes,
)
from specbench.models.pair import encode_turn, uses_chat
from specbench.results.summary import WEIGHT_DEPENDENT
from specbench.workloads.prompts import load_prompts

from ..helpers import cli, cli_on_tiny_pair, one_line_error

CPU = torch.device("cpu")
QWEN_PAIR = ("qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct")


def tiny_config(path, layers: int, hidden: int, vocab: int = 512, tied: bool = False):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        tie_word_embeddings=tied,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json_string())
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return tiny_config(root / "target.json", layers=4, hidden=64), tiny_config(root / "draft.json", layers=1, hidden=32)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_random_weights_at_a_synthetic_acceptance_keep_what_the_rate_decides(configs, prompts_file, tmp_path):
    # The rate, not the weights, decides alpha (the rate itself), tau and the predictions: they are shown,
    # as make gpu-check's synthetic runs need; exactness is not judged (the outputs are not the target's).
    out = tmp_path / "synthetic"
    result = cli(
        "run", "--target", configs[0], "--draft", configs[1], "--random-weights", "--prompt-tokens", "12",
        "--dataset", prompts_file, "--k", "2", "--max-new-tokens", "6", "--cost-repeats", "2",
        "--synthetic-acceptance", "0.6", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    spec = next(r for r in read_csv(out / "summary.csv") if r["method"] == "speculative")
    assert float(spec["alpha"]) == pytest.approx(0.6) and float(spec["tau"]) >= 1
    assert float(spec["predicted_speedup_verify"]) > 0 and float(spec["acceptance_rate"]) >= 0
    assert math.isnan(float(spec["outputs_match"]))
    assert all(
        float(r["alpha"]) == pytest.approx(0.6) for r in read_csv(out / "records.csv") if r["method"] != "baseline"
    )


def test_random_weights_run_end_to_end(configs, prompts_file, tmp_path):
    out = tmp_path / "random"
    result = cli(
        "run",
        "--target",
        configs[0],
        "--draft",
        configs[1],
        "--random-weights",
        "--prompt-tokens",
        "12",
        "--dataset",
        prompts_file,
        "--k",
        "2",
        "--max-new-tokens",
        "6",
        "--cost-repeats",
        "2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "predicted speedup at an assumed alpha" in result.stdout
    summary = {r["method"]: r for r in read_csv(out / "summary.csv")}
    spec = summary["speculative"]
    # alpha of random models means nothing: empty, and so is everything that follows from it.
    for column in WEIGHT_DEPENDENT:
        assert math.isnan(float(spec[column])), column
    assert float(spec["c"]) > 0 and float(spec["verify_ratio"]) > 0
    assert int(spec["outputs_match"]) == 3  # exactness holds whatever the weights: greedy equals the baseline
    records = read_csv(out / "records.csv")
    assert {r["prompt_tokens"] for r in records} == {"12"}
    assert {r["new_tokens"] for r in records} == {"6"}  # no stop token: every decode runs to --max-new-tokens
    assert all(math.isnan(float(r["alpha"])) for r in records)
    predicted = read_csv(out / "predicted.csv")
    costs = {int(r["tokens"]): float(r["ratio"]) for r in read_csv(out / "verify_cost.csv") if r["model"] == "target"}
    assert [float(r["alpha"]) for r in predicted if r["k"] == "1"] == [0.5, 0.6, 0.7, 0.8]
    assert {int(r["k"]) for r in predicted} == set(range(1, max(costs)))
    row = next(r for r in predicted if r["alpha"] == "0.7" and r["k"] == "3")
    c, verify = float(row["c"]), costs[4]
    assert float(row["predicted_speedup_verify"]) == pytest.approx((1 - 0.7**4) / (0.3 * (3 * c + verify)))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["resolved"]["weights"] == "random"

    # theory reads the same costs back and predicts the same figures.
    theory = cli("theory", "--costs", str(out), "--alpha", "0.7", "--format", "csv")
    assert theory.returncode == 0, theory.stderr
    line = next(line for line in theory.stdout.splitlines() if line.startswith("0.7,3,"))
    assert float(line.split(",")[-1]) == pytest.approx(float(row["predicted_speedup_verify"]), rel=1e-5)


def test_random_prompts_take_the_lengths_the_dataset_encodes_to(configs, prompts_file, tmp_path):
    cfg = BenchConfig(
        target=configs[0], draft=configs[1], dataset=prompts_file, random_weights=True, num_prompts=3, ks=[2]
    )
    pair, conversations = prepare(cfg)
    ids = conversations.first
    tokenizer = length_tokenizer(pair.target)  # no tokenizer beside the config: the default target's
    prompts = load_prompts(prompts_file, 3)
    expected = [len(encode_turn(tokenizer, p, [], uses_chat(tokenizer, cfg.chat, False, cfg.target))) for p in prompts]
    assert [len(x) for x in ids] == expected and len(set(expected)) > 1
    assert all(int(x.max()) < pair.target_lm.width for x in ids)
    again = prepare(cfg)[1].first
    assert all(torch.equal(a, b) for a, b in zip(ids, again, strict=True))  # reproducible for a seed


def test_random_prompts_without_a_tokenizer_need_their_lengths_given(configs, prompts_file, monkeypatch):
    monkeypatch.setattr(
        "specbench.models.load.tokenizer_in", lambda directory: None
    )  # none beside the config, none bundled
    cfg = BenchConfig(
        target=configs[0], draft=configs[1], dataset=prompts_file, random_weights=True, num_prompts=3, ks=[2]
    )
    with pytest.raises(SpecbenchError, match="no tokenizer to encode the prompts .*: pass --prompt-tokens N"):
        prepare(cfg)
    _, conversations = prepare(replace(cfg, prompt_tokens=8))  # lengths given: no tokenizer needed
    assert [len(ids) for ids in conversations.first] == [8, 8, 8]


@pytest.mark.parametrize(
    "alias, billions",
    [
        ("llama-7b", 6.74),
        ("llama-68m", 0.068),
        ("llama-160m", 0.162),
        ("qwen3-8b", 8.19),  # its model card: 8.2B, 6.95B without the embeddings
        ("qwen3-0.6b", 0.596),  # 0.6B, 0.44B without the (tied) embedding
        ("qwen2.5-7b-instruct", 7.61),  # its model card: 7.61B, 6.53B without the embeddings
        ("qwen2.5-0.5b-instruct", 0.494),  # 0.49B, 0.36B without the (tied) embedding
        ("smollm2-135m", 0.1345),
    ],
)
def test_shipped_architectures_have_their_models_parameter_counts(alias, billions):
    assert weight_bytes(alias, torch.float32) / 4 / 1e9 == pytest.approx(billions, rel=0.01)


def test_random_weights_fall_back_to_bfloat16_when_float32_does_not_fit(configs, monkeypatch):
    cfg = BenchConfig(target=configs[0], draft=configs[1], random_weights=True)
    need = sum(weight_bytes(spec, torch.float32) for spec in configs)
    monkeypatch.setattr("specbench.models.load.available_memory", lambda: need)  # fits only at half the size
    assert random_weights_dtype(cfg.wanted, CPU) == torch.bfloat16
    cfg.dtype = "float32"
    with pytest.raises(SpecbenchError, match="--dtype bfloat16"):
        random_weights_dtype(cfg.wanted, CPU)
    monkeypatch.setattr("specbench.models.load.available_memory", lambda: 10 * need)
    assert random_weights_dtype(cfg.wanted, CPU) == torch.float32


def test_random_models_are_built_on_the_device_in_the_dtype(configs):
    model = random_model(configs[0], CPU, torch.bfloat16, seed=3)
    params = list(model.model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.device == CPU for p in params)
    assert model.tokenizer is None and model.stop_ids == frozenset()
    weights = model.model.model.layers[0].self_attn.q_proj.weight.float()
    assert weights.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.model.model.norm.weight, torch.ones_like(model.model.model.norm.weight))
    again = random_model(configs[0], CPU, torch.bfloat16, seed=3).model.model.layers[0].self_attn.q_proj
    assert torch.equal(again.weight.float(), weights)


def test_a_tied_output_head_is_the_random_embedding(tmp_path):
    model = random_model(tiny_config(tmp_path / "tied.json", 1, 32, tied=True), CPU, torch.float32).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt-tokens", "8"], "--random-weights"),
        (["--device-map", "everywhere"], "--device-map everywhere"),
        (["--assume-alpha", "0.5,x"], "--assume-alpha"),
        (["--random-weights", "--device-map", "auto"], "--device-map"),
        # 256 positions: it was cut to what fits, unsaid (a hunt asked for 5,000 of a 2,048 window)
        (["--random-weights", "--prompt-tokens", "300"], "--prompt-tokens 300 with --max-new-tokens"),
    ],
)
def test_bad_random_weight_and_device_map_options_are_one_line(configs, tmp_path, args, needle):
    pair = ["--target", configs[0], "--draft", configs[1]]
    one_line_error(cli("run", *pair, *args, "--out", str(tmp_path / "run")), needle)


def test_random_pair_with_different_vocabularies_is_refused(configs, tmp_path):
    other = tiny_config(tmp_path / "other.json", layers=1, hidden=32, vocab=600)
    pair = ["--target", configs[0], "--draft", other]
    result = cli("run", *pair, "--random-weights", "--prompt-tokens", "8", "--out", str(tmp_path / "run"))
    one_line_error(result, "vocabularies of 512 and 600")


def test_aliases_of_one_vocabulary_pair_over_the_narrower_width_and_others_are_refused():
    """Qwen2.5-7B pads its embedding to 152,064 rows, 0.5B to 151,936; without tokenizers, their aliases'
    vocabulary (models.toml) says they share one. Qwen3's is another, so a 7B of Qwen2.5 is refused it."""
    target, draft, other = (skeleton(alias, random_weights=True) for alias in QWEN_PAIR + ("qwen3-0.6b",))
    assert (target.width, draft.width) == (152064, 151936) and target.tokenizer is None
    assert shared_width(target, draft) == 151936
    with pytest.raises(SpecbenchError, match="vocabularies of 152064 and 151936 tokens"):
        shared_width(target, other)


def test_an_aliases_hub_id_takes_its_shipped_architecture_and_vocabulary():
    # A hunt's --random-weights --target JackFram/llama-68m was refused (no config cached, no network),
    # though the llama-68m alias ships that hub id's architecture.
    hub = "Qwen/Qwen2.5-7B-Instruct"  # qwen2.5-7b-instruct's
    target, draft = skeleton(hub, random_weights=True), skeleton(QWEN_PAIR[1], random_weights=True)
    assert target.width == skeleton(QWEN_PAIR[0], random_weights=True).width == 152064
    assert shared_width(target, draft) == 151936  # paired as the aliases are
    with pytest.raises(SpecbenchError, match="no architecture config for 'org/unknown'"):
        skeleton("org/unknown", random_weights=True)


def padded_pair(tmp_path, monkeypatch, weights: bool = True):
    """A random target of 512 rows beside a draft of 480, their configs named as two aliases of one vocabulary."""
    from specbench.models.pair import load_pair

    target = tiny_config(tmp_path / "target.json", layers=2, hidden=64, vocab=512)
    draft = tiny_config(tmp_path / "draft.json", layers=1, hidden=32, vocab=480)
    monkeypatch.setattr("specbench.models.load.vocabulary", lambda spec: "one")
    wanted = Wanted(target, draft, device="cpu", dtype="float32", random_weights=True, weights=weights)
    return load_pair(wanted, False, graphs=False)


def test_vllms_draft_model_speculation_is_refused_a_draft_of_another_size_before_an_engine_starts(
    tmp_path, monkeypatch
):
    # vLLM's SpeculativeConfig refuses a draft whose vocabulary size is not the target's (its
    # verify_equal_vocab_size_if_draft_model), which it would say only after the baseline's engine ran.
    from types import SimpleNamespace

    from specbench.bench.run import serving_run

    pair = padded_pair(tmp_path, monkeypatch, weights=False)
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))  # where model_dir writes vLLM's config copies
    conversations = SimpleNamespace(longest=16)
    cfg = BenchConfig(engines=["vllm"], methods=["draft"], ks=[2])
    with pytest.raises(SpecbenchError, match="has 512 rows where .* has 480: run the pair in specbench's loop"):
        serving_run(cfg, pair, conversations, tmp_path / "run")
    ngram = BenchConfig(engines=["vllm"], methods=["ngram"], ks=[2])  # no draft model: nothing to refuse
    assert [d.method.name for d in serving_run(ngram, pair, conversations, tmp_path / "run").plan] == ["ngram"]


def test_transformers_generate_scores_the_width_the_loop_scores(tmp_path, monkeypatch):
    """A random target of 512 rows beside a draft of 480, of one vocabulary: the loop scores 480, and
    hf-generate (and the audit's samples from it) must not pick the 32 padding rows, which random
    weights make as likely as any other (greedy picked one in 6 of these 8 prompts before)."""
    from specbench.decoding.decode import autoregressive_decode
    from specbench.decoding.sampling import Sampling
    from specbench.engines.hf import hf_generate, hf_samples
    from specbench.engines.loop import Settings

    pair = padded_pair(tmp_path, monkeypatch)
    assert (pair.width, pair.target.width) == (480, 512)
    greedy = Settings(48, Sampling(0.0))
    for seed in range(8):
        prompt = torch.randint(pair.width, (8,), generator=torch.Generator().manual_seed(seed))
        want = autoregressive_decode(pair.target_lm, prompt, 48, greedy.sampling, torch.Generator()).tokens
        assert hf_generate(pair.target, prompt, greedy, 0, frozenset(), width=pair.width).tokens == want
    samples = hf_samples(pair.target, prompt, Settings(48, Sampling(1.0)), 0, frozenset(), 8, pair.width)
    assert max(max(answer) for answer in samples) < pair.width


def test_unknown_architecture_is_one_line(tmp_path):
    pair = ["--target", "org/not-cached", "--draft", "llama-68m"]
    result = cli("run", *pair, "--random-weights", "--out", str(tmp_path / "run"))
    one_line_error(result, "no architecture config for 'org/not-cached'", "config.json")


def test_device_map_on_cpu_is_recorded(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "mapped"
    args = ["--device-map", "auto", "--dataset", prompts_file, "--k", "2", "--max-new-tokens", "6"]
    result = cli_on_tiny_pair("run", tiny_pair, *args, "--cost-repeats", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "meta.json").read_text())["resolved"]["device_map"] == {"": "cpu"}
    assert all(r["outputs_match"] == "True" for r in read_csv(out / "records.csv"))


def test_offloading_device_maps_are_warned_about():
    assert offload_warning({"": "cpu"}) is None  # a CPU run, not an offloaded GPU run
    assert offload_warning({"model.layers.0": 0, "model.layers.1": 1}) is None
    assert "not GPU timings" in offload_warning({"model.layers.0": 0, "lm_head": "cpu"})
    assert "disk" in offload_warning({"model": "disk"})
