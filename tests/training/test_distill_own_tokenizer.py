"""``specbench distill --tokenizer-vocab N`` (training/draft_tokenizer.py, training/distill_own_tokenizer.py):
the draft's own tokenizer loads with AutoTokenizer and round-trips text exactly with the target's special
tokens and chat template; the student's vocabulary is that tokenizer's and it learns the target's
answers in its own tokens (a student trained on the target's ids fails the same check); training resumes
to the weights of an uninterrupted run; an --init draft keeps its layers; bad options are one line."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import load
from specbench.training import distill_own_tokenizer as own
from specbench.training.distill import DistillConfig
from specbench.training.distill_own_tokenizer import distill_own_vocabulary
from specbench.training.draft_tokenizer import token_bytes, train_tokenizer

from ..helpers import CORPUS, build_llama, build_tokenizer, cli, one_line_error, write_sources

CPU, F32 = torch.device("cpu"), torch.float32
CHAT = ("<|im_start|>", "<|im_end|>")
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "  leading spaces,\ttabs,\r\nCRLF and trailing spaces   ",
    "héllo wörld, naïve café; 日本語のテキスト; emoji 🙂🚀; Ελληνικά",
    "<|im_start|>user\nwhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "a literal <|im_start without its end, <eos> and \x00\x07 control bytes",
    "",
]


def chat_tokenizer(path: Path):
    """A target's tokenizer with chat tokens and a chat template, as an instruct model's."""
    tokenizer = build_tokenizer(path, special=CHAT)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> str:
    """A 2-layer untied random Llama with chat_tokenizer's tokenizer: it writes varied text."""
    root = tmp_path_factory.mktemp("chat")
    return str(build_llama(root / "target", chat_tokenizer(root / "tok"), layers=2, hidden=32, seed=0, tie=False))


def tiny_config(out: Path, sources: Path, **more) -> DistillConfig:
    sizes = dict(hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate_size=64, seq_len=32, batch=2)
    data = dict(teacher_tokens=0, top_k=8, generate_prompts=4, generate_new_tokens=12, generate_batch=2)
    training = dict(tokenizer_vocab=300, epochs=12, lr=1e-2, warmup_steps=5, save_every=1, sampled_fraction=0.0)
    return DistillConfig(out=out, sources=[str(sources)], **{**sizes, **data, **training, **more})


# ---------------------------------------------------------------- the tokenizer


def test_the_tokenizer_loads_offline_round_trips_and_keeps_the_targets_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    target = chat_tokenizer(tmp_path / "target")
    train_tokenizer(CORPUS + TEXTS[:3], 400, target).save_pretrained(tmp_path / "own")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "own").iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "own", local_files_only=True)
    assert tokenizer.get_vocab() != target.get_vocab() and 256 < len(tokenizer) <= 400
    for text in [*TEXTS, "never seen: Ωμέγα ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b\ufeff"]:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
        assert b"".join(token_bytes(tokenizer)[i] for i in ids) == text.encode()  # what text agreement reads
    # The target's special tokens: one id each, never split, never learned into merges.
    for token in (*CHAT, "<eos>"):
        assert tokenizer(token).input_ids == [tokenizer.convert_tokens_to_ids(token)]
        assert tokenizer.added_tokens_decoder[tokenizer.convert_tokens_to_ids(token)].special
    assert (tokenizer.eos_token, tokenizer.chat_template, tokenizer.padding_side) == (
        target.eos_token,
        TEMPLATE,
        target.padding_side,
    )
    chat = [{"role": "user", "content": "def add(a, b):"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == target.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(rendered).input_ids)
    assert tokens.count("<|im_start|>") == 2 and tokens.count("<|im_end|>") == 1
    assert not any("<|" in t or "|>" in t for t in tokens if t not in CHAT)  # whole tokens, never pieces


def test_the_tokenizer_adds_what_the_targets_adds_around_a_text(tmp_path):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = build_tokenizer(tmp_path / "t", special=("<s>",)).backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    target = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<eos>")
    tokenizer = train_tokenizer(CORPUS, 300, target)
    ids = tokenizer("def add").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "def add"
    assert tokenizer("def add", add_special_tokens=False).input_ids == ids[1:]


def test_each_tokens_embedding_starts_as_the_mean_of_the_targets_rows_of_its_text(tmp_path):
    target = chat_tokenizer(tmp_path / "target")
    tokenizer = train_tokenizer(CORPUS + TEXTS[:3], 400, target)
    source = torch.randn(len(target), 8)
    rows, found = own.mapped_rows(tokenizer, target, source)
    for token, text in (("Ġreturn", " return"), ("<|im_end|>", "<|im_end|>")):
        i = tokenizer.convert_tokens_to_ids(token)
        ids = target(text, add_special_tokens=False).input_ids
        assert found[i] and torch.allclose(rows[i], source[ids].mean(0))
    lone = tokenizer.convert_tokens_to_ids("Ã")  # the byte 0xC3: the first half of é, no text alone
    assert not found[lone] and not rows[lone].any()


# ---------------------------------------------------------------- held-out agreement


def test_text_agreement_counts_a_token_whose_text_begins_the_answer(tmp_path, monkeypatch):
    """Per position: the guess's text must begin the rest of the answer (a shorter token than the
    answer's counts; one that runs into the closing special token does not), and only the very id
    counts as token agreement."""
    tokenizer = train_tokenizer(["the theme then the end"] * 20, 300, chat_tokenizer(tmp_path / "target"))
    of = tokenizer.convert_tokens_to_ids
    answer = [of("Ġthe"), of("Ġend"), of("<|im_end|>")]
    example = own.one_hot(torch.tensor([of("the")] + answer), 0)
    guesses = [of("Ġ"), of("Ġend"), of("<|im_end|>")]  # a prefix, the token, the special token
    wrong = [of("Ġthe"), of("Ġthe"), of("Ġend")]  # the text goes on " end", not " the"; a special needs its id

    def agreement(guessed):
        logits = torch.full((len(guessed), len(tokenizer)), -1.0)
        logits[range(len(guessed)), guessed] = 1.0
        monkeypatch.setattr(own, "labelled_logits", lambda student, batch: logits)
        special = set(tokenizer.added_tokens_decoder)
        return own.text_agreement(torch.nn.Linear(1, 1), [example], token_bytes(tokenizer), special, 4)

    assert agreement(guesses) == (1.0, 2 / 3)
    assert agreement(wrong) == (1 / 3, 1 / 3)
    assert own.text_agreement(None, [], [], set(), 4) is None  # no held-out answer: no figure


# ---------------------------------------------------------------- distillation


def writes_the_answer(out: Path, answer: own.StoredAnswer) -> bool:
    """Whether the draft saved in ``out``, loaded with transformers, writes ``answer`` greedily after its prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=F32).eval()
    ids = tokenizer(answer.prompt, add_special_tokens=False).input_ids
    want = tokenizer(answer.answer, add_special_tokens=False).input_ids
    with torch.no_grad():
        for _ in want:
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tokenizer.decode(ids[-len(want) :]) == answer.answer


def test_the_draft_has_its_own_vocabulary_and_writes_the_targets_answers_in_it(chat_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = load(chat_target, CPU, F32)
    cfg = tiny_config(tmp_path / "draft", write_sources(tmp_path))
    phases = [p.phase for p in distill_own_vocabulary(cfg, target)]
    assert "tokenizer" in phases and phases[-1] == "student" and not any(p.startswith("teacher") for p in phases)
    tokenizer = AutoTokenizer.from_pretrained(cfg.out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(cfg.out, local_files_only=True)
    assert tokenizer.get_vocab() != target.tokenizer.get_vocab()
    assert model.config.vocab_size == len(tokenizer) == model.get_input_embeddings().weight.shape[0]
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids(target.tokenizer.eos_token)
    assert tokenizer.chat_template == TEMPLATE and not (cfg.out / "head_tokens.json").exists()
    answers = own.stored_answers(cfg, target.tokenizer)
    held = [a for a in answers if a.held_out]
    assert len(held) == 1 and held[0] is answers[0]  # every 16th greedy answer, as for a same-tokenizer draft
    # The student learned the target's answer (the prompts repeat: the held-out one is one it trained
    # on) in its own tokens.
    assert writes_the_answer(cfg.out, held[0])
    recipe = json.loads((cfg.out / "distill.json").read_text())
    assert recipe["tokenizer_vocab"] == 300 and recipe["tokenizer_tokens"] == len(tokenizer)
    assert recipe["held_out_greedy_agreement"] == recipe["held_out_token_agreement"] == 1.0
    assert recipe["held_out_target_tokens_per_draft_token"] > 0 and recipe["head_tokens"] is None
    # Finished: a rerun trains nothing.
    assert "student" not in [p.phase for p in distill_own_vocabulary(cfg, target)]


def test_a_student_trained_on_the_targets_ids_fails_the_check(chat_target, tmp_path, monkeypatch):
    """The broken control: the answers as the target's ids (brought into the draft's vocabulary, so
    that training runs) instead of re-tokenized."""
    target = load(chat_target, CPU, F32)
    right = own.answer_example

    def target_ids(tokenizer, answer):
        example = right(target.tokenizer, answer)
        if example is not None:
            example.ids, example.top_idx = example.ids % len(tokenizer), example.top_idx % len(tokenizer)
        return example

    monkeypatch.setattr(own, "answer_example", target_ids)
    cfg = tiny_config(tmp_path / "draft", write_sources(tmp_path))
    list(distill_own_vocabulary(cfg, target))
    held = next(a for a in own.stored_answers(cfg, target.tokenizer) if a.held_out)
    assert not writes_the_answer(cfg.out, held)


def test_training_resumes_to_the_weights_of_an_uninterrupted_run(chat_target, tmp_path):
    from safetensors.torch import load_file

    target = load(chat_target, CPU, F32)
    sources = write_sources(tmp_path)
    whole = tiny_config(tmp_path / "whole", sources, epochs=3)
    list(distill_own_vocabulary(whole, target))
    cut = dataclasses.replace(whole, out=tmp_path / "cut")
    for p in distill_own_vocabulary(cut, target):
        if p.phase == "student" and p.done == 4:
            break  # interrupted after four saved steps
    assert not (cut.out / "config.json").exists()
    resumed = [p for p in distill_own_vocabulary(cut, target)]
    assert resumed[0].phase == "generate" and resumed[1].phase == "tokenizer" and resumed[1].done == 1
    assert [p.done for p in resumed if p.phase == "student"][0] == 5
    a, b = load_file(whole.out / "model.safetensors"), load_file(cut.out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (whole.out / "tokenizer.json").read_text() == (cut.out / "tokenizer.json").read_text()
    # A resumed run with another --tokenizer-vocab is refused: the stored tokenizer is another's.
    with pytest.raises(SpecbenchError, match="--tokenizer-vocab 300"):
        list(distill_own_vocabulary(dataclasses.replace(cut, tokenizer_vocab=512), target))


def test_an_init_draft_of_the_targets_tokenizer_keeps_its_layers_and_maps_its_embeddings(chat_target, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    target = load(chat_target, CPU, F32)
    earlier = build_llama(tmp_path / "earlier", target.tokenizer, layers=1, hidden=32, seed=3)
    sources = write_sources(tmp_path)
    cfg = tiny_config(tmp_path / "draft", sources, init=str(earlier), lr=0.0, epochs=1)
    list(distill_own_vocabulary(cfg, target))
    before, after = load_file(earlier / "model.safetensors"), load_file(cfg.out / "model.safetensors")
    for name in before:
        if "embed" not in name and "lm_head" not in name:  # every layer as it was (in half precision)
            torch.testing.assert_close(after[name].float(), before[name].half().float())
    tokenizer = AutoTokenizer.from_pretrained(cfg.out)
    i = tokenizer.convert_tokens_to_ids("Ġreturn")
    ids = target.tokenizer(" return", add_special_tokens=False).input_ids
    embed = before["model.embed_tokens.weight"]
    torch.testing.assert_close(after["model.embed_tokens.weight"][i].float(), embed[ids].mean(0).half().float())
    # Training goes on from a draft with its own tokenizer: it keeps that tokenizer and its weights.
    more = dataclasses.replace(cfg, out=tmp_path / "more", init=str(cfg.out), tokenizer_vocab=600)
    list(distill_own_vocabulary(more, target))
    assert (more.out / "tokenizer.json").read_text() == (cfg.out / "tokenizer.json").read_text()
    kept = [json.loads((o / "tokenizer" / "trained.json").read_text())["kept_from"] for o in (cfg.out, more.out)]
    assert kept == [None, str(cfg.out)]
    again = load_file(more.out / "model.safetensors")
    assert all(torch.equal(again[k], after[k]) for k in after)


def test_the_command_trains_a_draft_with_its_own_tokenizer(chat_target, tmp_path):
    out = tmp_path / "draft"
    result = cli(
        "distill", "--target", chat_target, "--out", str(out), "--source", str(write_sources(tmp_path)),
        "--tokenizer-vocab", "300", "--hidden-size", "32", "--layers", "1", "--intermediate-size", "64",
        "--teacher-tokens", "0", "--generate-prompts", "4", "--generate-new-tokens", "8", "--generate-batch", "2",
        "--epochs", "1", "--batch", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "draft's own tokenizer 1/1" in result.stdout and "begins the target's text at" in result.stdout
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer" / "trained.json").is_file()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--tokenizer-vocab", "100"], ["--tokenizer-vocab must be 0", "at least 300"]),
        (["--tokenizer-vocab", "512", "--kind", "eagle"], ["--tokenizer-vocab", "--kind draft"]),
        (["--tokenizer-vocab", "512", "--draft-vocab", "64"], ["--tokenizer-vocab", "without --draft-vocab"]),
        (["--tokenizer-vocab", "512", "--generate-prompts", "0", "--teacher-tokens", "0"], ["--generate-prompts"]),
    ],
)
def test_bad_tokenizer_options_are_one_line(chat_target, tmp_path, args, needles):
    one_line_error(cli("distill", "--target", chat_target, "--out", str(tmp_path / "o"), *args), *needles)
