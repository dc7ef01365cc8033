"""What `specbench distill --data` asks the target: mixtures by weight, ShareGPT without the
conversations the benchmark evaluates on, and never a Spec-Bench or MT-Bench question."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.models.load import load
from specbench.training.distill_data import SHAREGPT_EVALUATED, parse_data, shares, training_prompts
from specbench.training.held_out import held_out_fingerprints, overlaps, write_fingerprints

from ..helpers import cli, one_line_error

CPU, F32 = torch.device("cpu"), torch.float32

LONG = (
    "Imagine you are writing a travel blog post about a recent trip to Hawaii, highlighting the "
    "cultural experiences and the must-see attractions, and then describe in detail how the food "
    "of the islands surprised you on the second day of the journey there."
)
MEDIUM = "Describe five key principles in evaluating an argument in analytical writing for students."
SHORT = "Who sang the song about the old oak tree?"  # 9 words: a qa-sized question
GENERIC = "Can you parallelize it?"  # a follow-up of 4 words: no one could memorise it


def write_questions(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"question_id": 1, "category": "writing", "turns": [LONG, GENERIC]},
        {"question_id": 2, "category": "writing", "turns": [MEDIUM, "Now do it again."]},
        {"question_id": 3, "category": "qa", "turns": [SHORT]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_mixtures_parse_by_weight_and_bad_ones_are_named(tmp_path):
    file = tmp_path / "mine.jsonl"
    file.write_text('{"turns": ["hello there"]}\n')
    parts = parse_data(f"sharegpt:3, humaneval, {file}:0.5")
    assert [(p.source, p.weight) for p in parts] == [("sharegpt", 3.0), ("humaneval", 1.0), (str(file), 0.5)]
    assert shares(parts, 9) == [6, 2, 1] and sum(shares(parts, 100)) == 100
    for bad, needle in [
        ("sharegpt:0", "must be positive"),
        ("nothing.jsonl", "neither sharegpt nor humaneval nor a file"),
        ("sharegpt,sharegpt:2", "named twice"),
        (" , ", "--data is empty"),
    ]:
        with pytest.raises(SpecbenchError, match=needle):
            parse_data(bad)


def test_a_copied_question_is_caught_and_other_chat_is_not(tmp_path):
    questions = write_questions(tmp_path / "question.jsonl")
    shipped = tmp_path / "held.npy"
    write_fingerprints(questions, shipped)
    sampled = set(np.load(shipped).tolist())  # every fourth shingle of a long turn, all of a short one's
    from specbench.training.held_out import turn_fingerprints

    full = turn_fingerprints([LONG, GENERIC, MEDIUM, SHORT])
    assert len(sampled) < len(full)
    copies = [
        "Please help me. " + LONG.upper().replace(",", ";") + " Thanks!",  # case and punctuation changed
        "my teacher asked: " + MEDIUM,
        "quick one - " + SHORT.lower().rstrip("?") + " ... no idea",
    ]
    for held in (sampled, full):
        assert all(overlaps(text, held) for text in copies)
        assert not overlaps("Can you parallelize it? Here is my loop over the files.", held)
        assert not overlaps("Write a travel blog post about a trip to Iceland and its hot springs.", held)
        assert not overlaps("Who sang the song about the river?", held)  # a shorter run than the question


def test_sharegpt_skips_the_evaluated_conversations_parts_and_held_out_questions(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    write_questions(tmp_path / "datasets" / "spec-bench" / "question.jsonl")
    conversations = [
        {
            "id": f"c{i}_{i % 2}",  # odd ones are later parts of a split conversation
            "conversations": [{"from": "human", "value": f"Question {i}: tell me about topic {i}."}],
        }
        for i in range(SHAREGPT_EVALUATED + 40)
    ]
    conversations[SHAREGPT_EVALUATED + 2]["conversations"][0]["value"] = "Hi! " + MEDIUM  # id ..._0
    sharegpt = tmp_path / "datasets" / "sharegpt" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    sharegpt.parent.mkdir(parents=True)
    sharegpt.write_text(json.dumps(conversations))
    with caplog.at_level("INFO", logger="specbench"):
        chosen = training_prompts(parse_data("sharegpt"), 30, stubs=None, seed=0)
        again = training_prompts(parse_data("sharegpt"), 30, stubs=None, seed=0)
    numbers = [int(p.id[1:].split("_")[0]) for p in chosen]
    assert len(chosen) == 19  # 20 beginnings after the evaluated ones, less the one holding a question
    assert all(n >= SHAREGPT_EVALUATED and n % 2 == 0 for n in numbers)
    assert SHAREGPT_EVALUATED + 2 not in numbers and chosen == again
    assert "1 prompt(s) overlapping Spec-Bench or MT-Bench questions left out" in caplog.text
    assert "30 prompts wanted, it has 19" in caplog.text


def test_a_data_file_holding_a_benchmark_question_is_refused_in_one_line(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "empty"))
    held_out_fingerprints()  # as another test in this process may have, from a cache without the questions
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    write_questions(tmp_path / "cache" / "datasets" / "spec-bench" / "question.jsonl")
    mine = tmp_path / "mine.jsonl"
    mine.write_text(
        json.dumps({"id": "ok", "turns": ["tell me a story"]})
        + "\n"
        + json.dumps({"id": "bad", "turns": [SHORT]})
        + "\n"
    )
    args = ["--target", tiny_pair[0], "--data", str(mine), "--teacher-tokens", "0", "--out", str(tmp_path / "d")]
    one_line_error(cli("distill", *args), "--data", "overlap Spec-Bench", "bad", "remove them")


def test_distill_answers_a_mixture_by_its_weights(tiny_pair, tmp_path):
    from specbench.training.distill import DistillConfig, distill

    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "lib.py").write_text(
        "".join(
            f'def add_{i}(a: int, b: int) -> int:\n    """Add two numbers and return their sum plus {i}, whatever their type."""\n    return a + b + {i}\n\n\n'
            for i in range(8)
        )
    )
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(json.dumps({"id": f"q{i}", "turns": [f"hello number {i}, how are you"]}) + "\n" for i in range(8))
    )
    cfg = DistillConfig(
        out=tmp_path / "draft", hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate_size=64, seq_len=32,
        teacher_tokens=0, top_k=8, epochs=1, batch=2, sources=[str(sources)], data=f"{chat}:3,humaneval:1",
        generate_prompts=8, generate_new_tokens=4, generate_batch=4, max_prompt_tokens=400,
    )  # fmt: skip
    target = load(tiny_pair[0], CPU, F32)
    phases = {p.phase for p in distill(cfg, target)}
    assert phases == {"generate", "student"}  # --teacher-tokens 0: no labelling of the sources
    docs = [doc for path in sorted((cfg.out / "generated").glob("*.pt")) for doc in torch.load(path)]
    assert Counter(doc["source"] for doc in docs) == {"humaneval": 2, str(chat): 6}
    assert all(doc["prompt_len"] <= 400 for doc in docs)
    assert json.loads((cfg.out / "distill.json").read_text())["data"] == f"{chat}:3,humaneval:1"
