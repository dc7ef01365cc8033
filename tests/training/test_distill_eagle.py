"""``specbench distill --kind eagle`` (training/distill_eagle.py): the training-time test attends to what
inference attends to, the trained head loads and drafts outputs equal to the baseline's, training
resumes from its saved step, and bad input is refused in one line."""

import dataclasses
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.decoding.decode import autoregressive_decode, speculative_decode
from specbench.decoding.sampling import Sampling
from specbench.drafters.eagle import EagleDrafter
from specbench.models.eagle_head import EagleHead, HeadCache, HeadConfig, read_head, save_head
from specbench.models.fast import FastLlama
from specbench.models.lm import HFCausalLM
from specbench.models.load import load
from specbench.training.distill import DistillConfig
from specbench.training.distill_eagle import FEATURES, DividedBy, distill_eagle, feature_scale, ttt_outputs

from ..helpers import build_llama, build_tokenizer, cli, cli_on_tiny_pair, one_line_error, write_sources

CPU, F32 = torch.device("cpu"), torch.float32
STEPS = 3


def scrambled_head() -> EagleHead:
    torch.manual_seed(0)
    config = HeadConfig(32, 4, 2, 8, 64, vocab=50, draft_vocab=20, taps=(0, 1, 2), target_hidden=32)
    head = EagleHead(config, torch.randn(50, 32)).eval()
    for weight in head.parameters():
        weight.data.normal_(0, 0.3)  # far from the init, so a wrong mask shows
    return head


def matches_inference(head: EagleHead, length: int = 10) -> bool:
    """Whether chain t of the training-time test, at every step, equals the head drafting after
    reading the pairs up to t (EagleHead.step, as EagleDrafter calls it) and then its own outputs."""
    ids, features = torch.randint(0, 50, (2, length)), torch.randn(2, length, 96)
    with torch.no_grad():
        outs = ttt_outputs(head, ids, features, STEPS)
        for row in range(2):
            for t in range(length - STEPS):
                cache = HeadCache()
                out = head.step(ids[row, 1 : t + 2], head.fuse(features[row, : t + 1]), torch.arange(t + 1), cache)
                out = out[-1:]
                for step in range(STEPS):
                    if step:  # the next true token, at position t + step, with the chain's last output
                        out = head.step(ids[row, t + step + 1 : t + step + 2], out, torch.tensor([t + step]), cache)
                    if not torch.allclose(out[0], outs[step][row, t], atol=1e-5, rtol=1e-5):
                        return False
    return True


def test_each_training_step_attends_to_what_inference_attends_to():
    assert matches_inference(scrambled_head())


def test_the_comparison_catches_steps_that_see_earlier_positions_drafts(monkeypatch):
    """A training-time test whose step j also attends to the steps 1..j of earlier chains (a causal
    mask over every block): inference never holds those entries."""
    import specbench.training.distill_eagle as de

    monkeypatch.setattr(
        de, "ttt_mask", lambda length, step: torch.ones(length, length).tril().bool().repeat(1, step + 1)
    )
    assert not matches_inference(scrambled_head())


def test_fc_trains_on_features_divided_by_their_scale_and_saves_what_inference_applies(tmp_path):
    from torch.nn.utils import parametrize

    from specbench.models.student import Example

    head = scrambled_head()
    scale = torch.logspace(-1, 3, 96)  # taps and dimensions of very different sizes, as SmolLM2's
    features = torch.randn(12, 96) * scale
    examples = [
        Example(torch.zeros(7, dtype=torch.long), 0, None, None, features=f.clone()) for f in features.view(2, 6, 96)
    ]
    examples[0].features[0] *= 1e4  # a first position's massive activation is left out
    measured = feature_scale(examples)
    assert ((measured / scale).log().abs() < 1.5).all()  # within the spread of a 10-sample RMS
    parametrize.register_parametrization(head.fc, "weight", DividedBy(measured))
    trained = head.fc.parametrizations.weight.original
    with torch.no_grad():
        assert torch.allclose(head.fuse(features), (features / measured) @ trained.T, rtol=1e-4, atol=1e-4)
        want = head.fuse(features)
        parametrize.remove_parametrizations(head.fc, "weight")
        assert torch.allclose(head.fuse(features), want, rtol=1e-4, atol=1e-4)
        save_head(head, tmp_path / "head", 3)
        saved = read_head(tmp_path / "head", head.embed, 3, 32, 50)
        assert torch.allclose(saved.fuse(features), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def tiny_config(out: Path, sources: Path, **more) -> DistillConfig:
    sizes = dict(seq_len=32, teacher_tokens=128, teacher_batch=4, top_k=8, epochs=1, batch=2, save_every=1)
    data = dict(generate_prompts=3, generate_new_tokens=8, generate_batch=2, ttt_steps=STEPS)
    return DistillConfig(out=out, sources=[str(sources)], kind="eagle", **{**sizes, **data, **more})


TINY_ARGS = (
    "--seq-len", "32", "--teacher-tokens", "128", "--top-k", "8", "--epochs", "1", "--batch", "2",
    "--generate-prompts", "3", "--generate-new-tokens", "8", "--generate-batch", "2",
)  # fmt: skip


@pytest.mark.slow  # two CLI runs: about 2 minutes on 2 busy cores
def test_distill_kind_eagle_trains_a_head_that_runs_equal_to_the_baseline(tiny_pair, tmp_path):
    out = tmp_path / "head"
    sources = write_sources(tmp_path)
    result = cli(
        "distill", "--kind", "eagle", "--target", tiny_pair[0], "--out", str(out), "--source", str(sources), *TINY_ARGS
    )
    assert result.returncode == 0, result.stderr
    assert "--speculator" in result.stdout
    # In a log, each phase has timed lines (a bar would show its last frame only)
    phases = re.findall(r"^\[ *\d+\.\d s\] (.+?) \d+/\d+", result.stdout, re.MULTILINE)
    assert "target features (sequences)" in phases and phases[-1] == "EAGLE head training (steps)", phases
    assert re.search(
        r"minutes per phase, over every run on .+: teacher [\d.]+, generate [\d.]+, features", result.stdout
    )
    answers = json.loads((out / "generated" / "answers.json").read_text())
    assert answers["answers"] == 3 and 0 < answers["answer_tokens"] <= 3 * 8 and answers["bytes"] > 0
    target = load(tiny_pair[0], CPU, F32)
    config = target.model.config
    head = read_head(
        out, target.model.get_input_embeddings().weight, config.num_hidden_layers, config.hidden_size, target.width
    )
    assert head.config.taps == (2, 2, 1)  # vLLM's default layers of the 4-layer target
    assert head.config.intermediate == config.intermediate_size and head.config.hidden == config.hidden_size
    assert head.config.norm_before_residual  # as the head trained
    # The draft vocabulary: every id the teacher ranks first in the training data, sorted.
    ids = head.draft_ids.tolist()
    assert ids == sorted(ids) and 0 < len(ids) <= target.width
    recipe = json.loads((out / "distill.json").read_text())
    assert recipe["kind"] == "eagle" and len(recipe["held_out_agreement_by_step"]) == STEPS
    assert all(0 <= a <= 1 for a in recipe["held_out_agreement_by_step"])
    stored = torch.load(next((out / FEATURES / "generated").glob("*.pt")))
    assert stored[0].dtype == torch.float16 and stored[0].shape[1] == 3 * config.hidden_size
    run = tmp_path / "run"
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--method", "eagle,eagle-dynamic", "--speculator", str(out), "--k", "3",
        "--num-prompts", "2", "--max-new-tokens", "12", "--repeats", "1", "--warmup", "0", "--cost-repeats", "2",
        "--dataset", "humaneval", "--out", str(run),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(run / "summary.csv")
    eagle = summary[summary["method"].str.startswith("eagle")]
    assert len(eagle) == 2 and (eagle["outputs_match"] == 2).all()


@pytest.mark.slow  # four runs of the phases: about a minute on 2 busy cores
def test_head_training_resumes_from_its_saved_step(tiny_pair, tmp_path):
    target = load(tiny_pair[0], CPU, F32)
    # Two epochs: the three answers are to one stub (the sources repeat it), so one of them trains.
    cfg = tiny_config(tmp_path / "head", write_sources(tmp_path), epochs=2)
    steps = []
    for p in distill_eagle(cfg, target):
        if p.phase == "head":
            steps.append(p.done)
            if len(steps) == 2:
                break  # interrupted after two saved steps
    assert steps == [1, 2]
    assert not (cfg.out / "config.json").exists()
    interrupted = json.loads((cfg.out / "phases.json").read_text())  # what the interrupted run spent is kept
    assert set(interrupted) == {"teacher:teacher", "generate", "features", "head"}
    resumed = [p for p in distill_eagle(cfg, target) if p.phase == "head"]
    spent = json.loads((cfg.out / "phases.json").read_text())
    assert spent["head"] > interrupted["head"] and spent["generate"] >= interrupted["generate"]  # the runs add up
    assert resumed[0].done == 3 and resumed[-1].done == resumed[-1].total > 3
    assert (cfg.out / "config.json").exists()
    # Finished: a rerun recomputes nothing, and the features are kept.
    assert [p.phase for p in distill_eagle(cfg, target)].count("head") == 0
    # The same data continue into a longer run.
    longer = dataclasses.replace(cfg, epochs=3)
    assert [p.done for p in distill_eagle(longer, target) if p.phase == "head"][0] == resumed[-1].total + 1


def test_a_draft_directory_is_not_an_eagle_output_in_one_line(tiny_pair, tmp_path):
    result = cli("distill", "--kind", "eagle", "--target", tiny_pair[0], "--out", tiny_pair[1])
    one_line_error(result, "holds a draft", "--kind eagle")


def test_eagle_needs_a_llama_shaped_target(tiny_pair, tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=4, n_head=4, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SpecbenchError, match="Llama-shaped target"):
        next(distill_eagle(tiny_config(tmp_path / "h", tmp_path), load(str(tmp_path / "gpt2"), CPU, F32)))
    result = cli("distill", "--kind", "eagle", "--target", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o"))
    one_line_error(result, "Llama-shaped target (llama, mistral, qwen2, qwen3)", "gpt2")


@pytest.mark.slow  # about 40 s on 2 busy cores
def test_a_qwen3_target_gets_a_head_that_drafts_as_its_greedy_baseline(tiny_pair, tmp_path):
    # The pair most users bring is a Qwen3 target: its features are read from the same places (each
    # decoder layer's input, the final norm's output), and its head is an EAGLE-3 Llama layer.
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)  # confident rows, as build_llama's: no greedy near-ties
    model.save_pretrained(tmp_path / "qwen3")
    tokenizer.save_pretrained(tmp_path / "qwen3")
    target = load(str(tmp_path / "qwen3"), CPU, F32)
    for _ in distill_eagle(tiny_config(tmp_path / "head", write_sources(tmp_path)), target):
        pass
    embed = target.model.get_input_embeddings().weight
    head = read_head(tmp_path / "head", embed, 4, 64, target.width)
    assert head.config.head_dim == 32 and head.config.taps == (2, 2, 1)  # the target's; vLLM's default layers
    lm = HFCausalLM(target.model, target.width, fast=FastLlama(target.model))
    lm.record_features(head.config.taps)
    # A head trained this little drafts nothing the target keeps (the Llama runs above neither): what
    # this shows is a Qwen3 target's head built, read back and run through every round exactly.
    cfg, generator = Sampling(), torch.Generator()
    for prompt in ("def add_up(a", "print(", "return a +"):
        ids = torch.tensor(tokenizer(prompt)["input_ids"])
        base = autoregressive_decode(lm, ids, 16, cfg, generator).tokens
        result = speculative_decode(lm, EagleDrafter(head, lm, 3, cfg, generator), ids, 3, 16, cfg, generator)
        assert result.tokens == base and result.drafted > 0


def test_a_target_without_pad_or_eos_answers_in_padded_batches_as_it_answers_alone(tmp_path):
    """Llama's tokenizers have no pad token, and this one has no EOS either: batched generation pads
    explicitly, and the pads change nothing that is learned (the prompts are of different lengths)."""
    from transformers import PreTrainedTokenizerFast

    from specbench.training.distill import generated_shards, token_stream

    bare = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(tmp_path / "tok").backend_tokenizer)
    assert bare.pad_token is None and bare.eos_token is None
    target = load(str(build_llama(tmp_path / "target", bare, layers=4, hidden=64, seed=0)), CPU, F32)
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "lib.py").write_text(
        "".join(
            f'def f{i}(a: int, b: int) -> int:\n    """Return a value made{" carefully" * 3 * i} from the two numbers a and b."""\n'
            f"    return a + b * {i}\n\n\n"
            for i in range(4)
        )
    )
    assert None not in token_stream(bare, [sources / "lib.py"], 0)  # the teacher's text: no EOS between files
    answers = {}
    for batch in (1, 4):
        cfg = tiny_config(
            tmp_path / f"out{batch}", sources, generate_prompts=4, generate_batch=batch, sampled_fraction=0
        )
        list(generated_shards(cfg, target))
        docs = [doc for path in sorted((cfg.out / "generated").glob("*.pt")) for doc in torch.load(path)]
        answers[batch] = sorted(docs, key=lambda doc: doc["prompt_len"])
    assert len({doc["prompt_len"] for doc in answers[4]}) == 4  # one batch of four lengths: three rows padded
    for alone, padded in zip(answers[1], answers[4], strict=True):
        assert torch.equal(alone["ids"], padded["ids"]) and torch.equal(alone["top_idx"], padded["top_idx"])
        torch.testing.assert_close(alone["top_logp"], padded["top_logp"], atol=2e-3, rtol=0)
    assert target.tokenizer.pad_token is None  # the target's tokenizer is left as it was (a draft is saved with it)


def test_a_top_k_beyond_the_vocabulary_keeps_all_of_it(tiny_pair, tmp_path, caplog):
    target = load(tiny_pair[0], CPU, F32)
    cfg = tiny_config(tmp_path / "head", write_sources(tmp_path), top_k=10 * target.width)
    with caplog.at_level("INFO", logger="specbench"):
        for p in distill_eagle(cfg, target):
            if not p.phase.startswith("teacher"):
                break  # the teacher's shards are written
    assert f"--top-k {cfg.top_k} is more than" in caplog.text and f"{target.width} ids" in caplog.text
    shard = torch.load(cfg.out / "teacher" / "0000.pt")
    assert shard["top_idx"].shape[-1] == target.width
    assert torch.equal(shard["top_idx"][0, 0].sort().values, torch.arange(target.width, dtype=torch.int32))
    with pytest.raises(SpecbenchError, match="--top-k must be at least 1"):
        next(distill_eagle(dataclasses.replace(cfg, top_k=0), target))


def test_eagle_needs_a_target_of_three_layers(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    for layers in (1, 2):
        shallow = load(str(build_llama(tmp_path / f"t{layers}", tokenizer, layers=layers, hidden=64, seed=0)), CPU, F32)
        with pytest.raises(SpecbenchError, match=f"at least 3 decoder layers and .* has {layers}: use --kind draft"):
            next(distill_eagle(tiny_config(tmp_path / "h", tmp_path), shallow))
    result = cli("distill", "--kind", "eagle", "--target", str(tmp_path / "t2"), "--out", str(tmp_path / "o"))
    one_line_error(result, "at least 3 decoder layers", "has 2", "--kind draft")


def test_the_vocabulary_is_the_ids_ranked_first_most_often():
    from specbench.models.student import Example
    from specbench.training.distill import head_tokens

    def ranked_first(*ids):
        top = torch.tensor(ids)[:, None].repeat(1, 2)  # the teacher's top-2 at each position; top-1 is ids
        return Example(torch.zeros(len(ids) + 1, dtype=torch.long), 0, torch.zeros(len(ids), 2), top)

    examples = [ranked_first(7, 7, 3, 9), ranked_first(9, 7, 5, 3, 1)]  # 7 thrice; 3 and 9 twice; 1 and 5 once
    assert head_tokens(examples) == [1, 3, 5, 7, 9]
    assert head_tokens(examples, 3) == [3, 7, 9]
    assert head_tokens(examples, 4) == [1, 3, 7, 9]  # 1 and 5 tie: the lower id stays
    assert head_tokens(examples, 50) == head_tokens(examples, 0)  # no more ids than the data ranked first
    # With the target's vocabulary given, its lowest other ids fill a limit the data cannot.
    assert head_tokens(examples, 8, vocab=12) == [0, 1, 2, 3, 4, 5, 7, 9]
    assert head_tokens(examples, 3, vocab=12) == [3, 7, 9]
    assert head_tokens(examples, 50, vocab=12) == list(range(12))


def test_coverage_is_the_share_of_top_choices_a_vocabulary_holds():
    from specbench.models.student import Example
    from specbench.training.distill import coverage

    top = torch.tensor([[7, 1], [3, 2], [7, 0], [9, 9]])
    example = Example(torch.zeros(5, dtype=torch.long), 0, torch.zeros(4, 2), top)
    assert coverage([3, 7], [example]) == 0.75
    assert coverage([1, 2], [example]) == 0.0  # only the top choice counts
    assert coverage([3, 7], []) is None


def head_logits(head: EagleHead, ids: torch.Tensor, features: torch.Tensor) -> dict[int, torch.Tensor]:
    """The head's step-0 logit of each id it scores, at every position of ``ids`` (target ids)."""
    with torch.no_grad():
        logits = head.draft_logits(ttt_outputs(head, ids, features, 1)[0])
    return {t: logits[..., d] for d, t in enumerate(head.draft_ids.tolist())}


@pytest.mark.slow  # two runs of the phases: about a minute on 2 busy cores
def test_a_head_goes_on_training_from_its_checkpoint_with_a_new_vocabulary(tiny_pair, tmp_path):
    """--init HEAD keeps the head's weights (fc as inference applies it, though training holds it
    times the features' scale) and the LM head rows of the ids it scored; the ids the data add start
    as the target's rows. At learning rate 0 the head saved again drafts as the one it started from."""
    from specbench.training.distill_eagle import new_head

    target = load(tiny_pair[0], CPU, F32)
    sources = write_sources(tmp_path)
    earlier_ids = list(range(0, target.width, 2))
    earlier = new_head(tiny_config(tmp_path / "unused", sources), target, earlier_ids)
    torch.manual_seed(1)
    for weight in earlier.parameters():
        weight.data.normal_(0, 0.3)  # far from a fresh head's init, so a part not carried over shows
    save_head(earlier, tmp_path / "earlier", target.model.config.num_hidden_layers)
    cfg = tiny_config(tmp_path / "head", sources, init=str(tmp_path / "earlier"), lr=0.0, draft_vocab=12)
    list(distill_eagle(cfg, target))
    config = target.model.config
    embed = target.model.get_input_embeddings().weight
    before = read_head(tmp_path / "earlier", embed, config.num_hidden_layers, config.hidden_size, target.width)
    after = read_head(cfg.out, embed, config.num_hidden_layers, config.hidden_size, target.width)
    ids = after.draft_ids.tolist()
    assert len(ids) == 12
    kept, added = [t for t in ids if t in earlier_ids], [t for t in ids if t not in earlier_ids]
    assert kept and added  # the data kept some of the earlier ids and brought new ones
    torch.manual_seed(2)
    tokens, features = torch.randint(0, target.width, (2, 9)), torch.randn(2, 9, 3 * config.hidden_size) * 5
    old, new = head_logits(before, tokens, features), head_logits(after, tokens, features)
    for t in kept:
        torch.testing.assert_close(new[t], old[t], rtol=2e-2, atol=2e-2 * old[t].abs().max().item())
    rows = dict(zip(ids, after.lm_head.weight, strict=True))
    for t in added:
        torch.testing.assert_close(rows[t], target.model.get_output_embeddings().weight[t].half().float())
    assert json.loads((cfg.out / "distill.json").read_text())["init"] == str(tmp_path / "earlier")


def test_an_init_that_is_no_head_is_refused_in_one_line(tiny_pair, tmp_path):
    result = cli(
        "distill", "--kind", "eagle", "--target", tiny_pair[0], "--out", str(tmp_path / "o"),
        "--init", str(tmp_path / "nowhere"),
    )  # fmt: skip
    one_line_error(result, "--init", "nowhere", "EAGLE head's directory, alias or hub id")


def test_an_init_head_named_by_its_hub_id_says_what_the_hub_said(tmp_path, monkeypatch):
    # Offline and not cached: local_dir's line (what to download, where), not a list of what --init takes.
    import huggingface_hub
    from huggingface_hub import errors

    def snapshot_download(repo_id, **kwargs):
        raise errors.LocalEntryNotFoundError(f"{repo_id} is not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("specbench.core.environment.hub_reachable", lambda: False)
    with pytest.raises(SpecbenchError, match="model org/a-head is not in the local Hugging Face cache"):
        DistillConfig(out=tmp_path / "o", kind="eagle", init="org/a-head").validate()
    with pytest.raises(SpecbenchError, match="use pca, random, or an EAGLE head's directory, alias or hub id"):
        DistillConfig(out=tmp_path / "o", kind="eagle", init=str(tmp_path / "no-such-head")).validate()


def test_a_resumed_run_of_another_shape_is_refused_in_one_line(tiny_pair, tmp_path):
    target = load(tiny_pair[0], CPU, F32)
    cfg = tiny_config(tmp_path / "head", write_sources(tmp_path))
    for p in distill_eagle(cfg, target):
        if p.phase == "head":
            break  # a state saved after the first step, with every id the teacher ranked first
    # Refused as it starts, by the settings the state was saved with (stored.check_stored).
    with pytest.raises(SpecbenchError, match=r"a training state \(train_state.pt\) .*--draft-vocab 0 -> 3") as refused:
        list(distill_eagle(dataclasses.replace(cfg, draft_vocab=3), target))
    assert "\n" not in str(refused.value)


def test_bfloat16_training_runs_its_products_in_bfloat16_and_learns(tiny_pair, tmp_path):
    target = load(tiny_pair[0], CPU, F32)
    sources = write_sources(tmp_path)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny_config(tmp_path / dtype, sources, train_dtype=dtype, epochs=4)
        losses[dtype] = [p.loss for p in distill_eagle(cfg, target) if p.phase == "head"]
    # The same data, seed and first weights: the losses differ only by the products' rounding.
    first32, first16 = losses["float32"][0], losses["bfloat16"][0]
    assert first16 != first32 and abs(first16 - first32) < 0.05 * first32
    bf16 = losses["bfloat16"]
    assert sum(bf16[-3:]) < sum(bf16[:3])  # and it learns: the last epoch's losses against the first's
    recipe = json.loads((tmp_path / "bfloat16" / "distill.json").read_text())
    assert recipe["train_dtype"] == "bfloat16"


def test_an_unknown_train_dtype_is_refused_in_one_line(tiny_pair, tmp_path):
    result = cli("distill", "--target", tiny_pair[0], "--out", str(tmp_path / "d"), "--train-dtype", "float16")
    one_line_error(result, "--train-dtype float16", "float32 or bfloat16")
