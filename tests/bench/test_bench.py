"""The benchmark as a whole on tiny local models: K lists, random streams, resume, the schema."""

import dataclasses
import json
import logging
import math
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from specbench.bench.config import FIELDS_BEGIN, FIELDS_END, OPTIONS, READERS, BenchConfig, fields_source
from specbench.bench.run import Results, benchmark
from specbench.core.errors import SpecbenchError
from specbench.methods.registry import METHODS
from specbench.models import costs as costs_module
from specbench.results import report, schema
from specbench.results.report import phase_table, serving_table, summary_table

from ..helpers import cli, cli_on_tiny_pair, one_line_error, specbench

ROOT = Path(__file__).parents[2]


def config(tiny_pair, prompts_file, **options) -> BenchConfig:
    options = {
        "target": tiny_pair[0],
        "draft": tiny_pair[1],
        "dataset": prompts_file,
        "max_new_tokens": 16,
        "cost_repeats": 2,
        "warmup": 0,
        **options,
    }
    return BenchConfig(**options)


def run(cfg: BenchConfig, out: Path, resume: bool = False) -> Results:
    return [event for event in benchmark(cfg, out, resume) if isinstance(event, Results)][0]


def shown(table) -> str:
    """A rich table as text."""
    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()


def outputs(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_configuration_declares_one_field_per_option_as_the_declarations_write_it():
    source = Path(sys.modules[BenchConfig.__module__].__file__).read_text()
    block = source[source.index(FIELDS_BEGIN) + len(FIELDS_BEGIN) : source.index(FIELDS_END)]
    assert block == fields_source(), "run python -m specbench.bench.config to rewrite BenchConfig's fields"
    fields = {f.name: f for f in dataclasses.fields(BenchConfig)}
    assert list(fields) == list(OPTIONS)
    assert fields["ks"].type == "list[int]" and fields["assume_alpha"].type == "list[float]"
    assert fields["dataset_path"].type == "str | None" and fields["engine_args"].type == "dict"
    first, second = BenchConfig(), BenchConfig()
    first.ks.append(8)  # each configuration has lists of its own
    assert second.ks == OPTIONS["ks"].default == [4]


# A run with each part of a run (options.READ_BY's kinds) and one without it, for each kind.
WITH = {"engine": "engines", "method": "methods", "k-policy": "k_policies"}  # kinds of several values: lists
DATASETS = {"file": "my.jsonl", "workload": "spec-bench", "built-in": "humaneval", "long": "longcode"}
OTHERS = {
    "engine": ["torch", "vllm", "server", "llama-cpp"],
    "method": ["speculative", "prompt-lookup"],
    "k-policy": ["fixed", "heuristic", "confidence"],
    "dataset": list(DATASETS),
    "weights": ["checkpoint", "random"],
    "command": ["run", "audit"],
}


def run_of(parts: dict[str, str]) -> tuple[dict, str]:
    """Configuration fields and a command for a run with one part of each kind in ``parts``."""
    fields, command = {}, "run"
    for kind, value in parts.items():
        if kind in WITH:
            fields[WITH[kind]] = [value]
        elif kind == "dataset":
            fields["dataset"] = DATASETS[value]
        elif kind == "weights":
            fields["random_weights"] = value == "random"
        else:
            command = value
    return fields, command


def set_away(option) -> object:
    """A value of ``option`` that is not its default."""
    kind = type(option.default) if option.default is not None else option.kind
    value = {bool: True, int: 7, float: 0.5, str: "x", list: [7], dict: {"x": 1}}[kind]
    return (not option.default) if kind is bool else value


def test_every_option_that_some_runs_read_is_refused_in_a_run_without_its_readers():
    """Each option declares who reads it (Option.read_by; a method's, the methods that list it): set away
    from its default, it is refused in a run that lacks its readers of any one kind, naming them, and
    passes the check in a run that has one of each."""
    assert {"dataset_path", "repeats", "tensor_parallel_size", "baseline_url", "gguf_type", "kv_budget"} <= set(READERS)
    for name, readers in READERS.items():
        option, by_kind = OPTIONS[name], {}
        for reader in readers:
            kind, _, value = reader.partition(":")
            by_kind.setdefault(kind, []).append(value)
        having = {kind: values[0] for kind, values in by_kind.items()}
        fields, command = run_of(having)
        cfg = BenchConfig(**fields, **{name: set_away(option)})
        assert cfg.unread(name, command) is None, (name, having)
        for kind, values in by_kind.items():
            other = next(value for value in OTHERS[kind] if value not in values)
            fields, command = run_of({**having, kind: other})
            cfg = BenchConfig(**fields, **{name: set_away(option)})
            why = cfg.unread(name, command)
            assert why is not None and why.startswith(f"{option.flag} is read only by "), (name, kind, other)
            with pytest.raises(SpecbenchError, match=re.escape(why)):
                cfg.refuse_unread_options(command)
            cfg = BenchConfig(**fields)  # left at its default: nothing to refuse
            cfg.refuse_unread_options(command)


def test_a_k_list_sweeps_and_writes_best_k_and_the_plot(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    result = cli_on_tiny_pair(
        "run",
        tiny_pair,
        "--k",
        "1,2,4",
        "--dataset",
        prompts_file,
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "16",
        "--cost-repeats",
        "2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv")
    assert summary["k"].tolist()[1:] == [1, 2, 4] and summary["method"].tolist() == ["baseline"] + ["speculative"] * 3
    best = json.loads((out / "best_k.json").read_text())
    assert set(best["speculative"]["measured"]["by_k"]) == {"1", "2", "4"}
    assert (out / "sweep.png").stat().st_size > 10_000 and (out / "phases.png").stat().st_size > 10_000
    assert "best K for speculative" in result.stdout and "time per generated token" in result.stdout
    # Its output is a log, not a terminal: no bar (rich would draw its last frame only), but a line per
    # stage with the seconds since the command began, in order, then one when it finished.
    said = re.findall(r"^\[ *(\d+\.\d) s\] (.+)$", result.stdout, re.MULTILINE)
    stages = [text for _, text in said]
    assert stages[0] == "loading models and prompts" and stages[-1] == "finished", stages
    assert {
        "measuring copy bandwidth (baseline_mbu)",
        "measuring forward costs (c, verify_ratio)",
        "warming up",
        "decoding: speculative K=4 (8/8)",
    } <= set(stages)
    assert [float(s) for s, _ in said] == sorted(float(s) for s, _ in said)
    assert not re.search(r"\d+/\d+ \d+:\d\d:\d\d", result.stdout)  # a bar's count and elapsed time
    # show prints the run's tables again from its directory, as the run printed them
    shown = cli("show", out)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.strip()]
    assert "time per generated token" in shown.stdout and len(lines) > 15
    assert "baseline MBU" in shown.stdout and "launch-bound loop" in " ".join(shown.stdout.split())  # and its note
    assert [line for line in lines if line not in result.stdout.splitlines()] == []
    one_line_error(cli("show", tmp_path), "holds no results.json", "finished `specbench run`")


def test_sampled_outputs_of_a_method_do_not_depend_on_the_others_in_the_run(tiny_pair, prompts_file, tmp_path):
    sampled = {"temperature": 3.0, "ks": [2], "seed": 3}  # the tiny models are peaked: spread them
    run(config(tiny_pair, prompts_file, methods=["speculative"], **sampled), tmp_path / "alone")
    run(config(tiny_pair, prompts_file, methods=["prompt-lookup", "speculative"], **sampled), tmp_path / "together")

    def speculative(out):
        return [(o["prompt_id"], o["token_ids"]) for o in outputs(out) if o["method"] == "speculative"]

    assert speculative(tmp_path / "alone") == speculative(tmp_path / "together")
    # The streams are independent: the baseline's samples differ from speculative's.
    baseline = [o["token_ids"] for o in outputs(tmp_path / "alone") if o["method"] == "baseline"]
    assert baseline != [tokens for _, tokens in speculative(tmp_path / "alone")]


def test_an_interrupted_run_resumes_without_measuring_anything_twice(tiny_pair, prompts_file, tmp_path, monkeypatch):
    cfg, out = config(tiny_pair, prompts_file, methods=["speculative", "prompt-lookup"], ks=[1, 3]), tmp_path / "run"
    events = benchmark(cfg, out)
    for event in events:  # interrupt in the middle of the second prompt
        if event.stage == "decoding" and event.done == 5 + 2:
            break
    events.close()
    first = pd.read_csv(out / "records.csv")
    assert sorted(first["prompt_index"].unique()) == [0, 1]  # prompt 1 is incomplete
    bandwidth = json.loads((out / "meta.json").read_text())["resolved"]["copy_bandwidth"]
    # show says so (a hunt's show of a stopped run gave no sign of it)
    stopped = f"this run stopped after 2 of its 3 prompts: `specbench run` with its options and --resume --out {out}"
    assert Results.read(out).suggestions[0].startswith(stopped)

    # The kept records' MBU stays against the bandwidth they were measured with: it is not measured again.
    monkeypatch.setattr(costs_module, "copy_bandwidth", lambda *_: pytest.fail("copy bandwidth measured again"))
    results = run(cfg, out, resume=True)
    assert {r["copy_bandwidth_gbs"] for r in results.summary if r["engine"] == "torch"} == {bandwidth / 1e9}
    records = pd.read_csv(out / "records.csv")
    assert sorted(records.groupby(["prompt_index", "method", "k"], dropna=False).size().tolist()) == [1] * 3 * 5
    kept = first[first["prompt_index"] == 0].reset_index(drop=True)
    pd.testing.assert_frame_equal(records[records["prompt_index"] == 0].reset_index(drop=True), kept)  # timings too
    assert sorted((o["prompt_index"], o["method"], o["k"] or 0) for o in outputs(out)) == sorted(
        {(i, m, k) for i in range(3) for m, k in [("baseline", 0), *[(m, k) for m in cfg.methods for k in cfg.ks]]}
    )
    assert [r["num_prompts"] for r in results.summary] == [3] * 5
    assert not any("stopped after" in note for note in Results.read(out).suggestions)


def test_an_interrupted_run_says_where_its_rows_are_and_how_to_go_on(tiny_pair, prompts_file, tmp_path, monkeypatch):
    def interrupted(cfg, out, *args, **kwargs):  # Ctrl-C while the run decodes: its meta.json is written
        out.mkdir(parents=True)
        (out / "meta.json").write_text("{}")
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr("specbench.bench.run.benchmark", interrupted)
    out = tmp_path / "run"
    result = cli_on_tiny_pair("run", tiny_pair, "--dataset", prompts_file, "--out", str(out))
    assert result.returncode == 130
    assert f"interrupted: what was measured is in {out}/; the same command with --resume --out {out}" in " ".join(
        result.stderr.split()
    )
    # An online run cannot resume (its learning is not stored): it is not offered --resume.
    online = tmp_path / "online"
    result = cli_on_tiny_pair("run", tiny_pair, "--dataset", prompts_file, "--out", str(online), "--method", "online")
    assert result.returncode == 130
    said = " ".join(result.stderr.split())
    assert (
        f"interrupted: what was measured is in {online}/; --resume cannot restore what --method online learned" in said
    )
    assert "--resume --out" not in said

    # Before it had a run to resume (loading the models), no --resume to give: a review found one that failed.
    def loading(*args, **kwargs):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr("specbench.bench.run.benchmark", loading)
    early = cli_on_tiny_pair("run", tiny_pair, "--dataset", prompts_file, "--out", str(tmp_path / "early"))
    assert early.returncode == 130 and early.stderr.strip() == "interrupted before anything was measured"


def test_each_lookahead_policy_is_a_row_of_its_own_exact_under_greedy_and_resumed(
    tiny_pair, untied_target, prompts_file, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="specbench")
    cfg = config(
        (untied_target, tiny_pair[1]),  # varied text: rejections, and rounds where the draft is unsure
        prompts_file,
        methods=["speculative", "prompt-lookup", "tree"],
        ks=[1, 3],
        k_policies=["heuristic", "fixed", "confidence"],
        draft_p_min=0.97,
    )
    steps, out = 1 + len(cfg.plan), tmp_path / "run"
    events = benchmark(cfg, out)
    for event in events:  # interrupt in the middle of the second prompt
        if event.stage == "decoding" and event.done == steps + 2:
            break
    events.close()
    results = run(cfg, out, resume=True)
    # Methods that cannot take a policy run what they can, and the run says so once each.
    notes = [r.message for r in caplog.records if "--k-policy" in r.message]
    assert (
        notes
        == [
            "prompt-lookup takes only --k-policy fixed, heuristic: no confidence rows",
            "tree takes only --k-policy fixed: no heuristic, confidence rows",
        ]
        * 2
    )  # the run, then its resumption
    served = dataclasses.replace(
        cfg, methods=["speculative", "hf-assisted"], engines=["torch", "vllm"], k_policies=["heuristic"]
    )
    assert served.policy_notes == [
        "hf-assisted takes only --k-policy fixed: no heuristic rows",  # it runs fixed K instead
        "vllm draft takes only --k-policy fixed: no heuristic rows",
    ]
    assert [decoder.k_policy for decoder in served.plan if decoder.method.name == "hf-assisted"] == ["fixed", "fixed"]
    summary = pd.DataFrame(results.summary).set_index(["method", "k", "k_policy"])
    assert set(summary.loc["speculative"].index) == {
        (k, p) for k in (1, 3) for p in ("heuristic", "fixed", "confidence")
    }
    assert set(summary.loc["prompt-lookup"].index) == {(k, p) for k in (1, 3) for p in ("heuristic", "fixed")}
    assert summary.loc["tree"].index.tolist() == [(2, "fixed")] and results.summary[0]["k_policy"] == ""
    assert (summary["outputs_match"] == 3).all() and (summary["num_prompts"] == 3).all()  # greedy: every prompt
    records = pd.read_csv(out / "records.csv")
    assert (
        not records.duplicated(["prompt_index", "method", "k", "tree", "k_policy"]).any() and len(records) == 3 * steps
    )
    assert records["outputs_match"].all()
    # The confidence threshold is that row's setting; the fixed-K formulas leave the adaptive rows.
    speculative = summary.loc["speculative"]
    assert speculative["options"].to_dict() == {
        (k, p): "draft_p_min=0.97" if p == "confidence" else ""
        for k in (1, 3)
        for p in ("heuristic", "fixed", "confidence")
    }
    fixed = speculative.xs("fixed", level="k_policy")
    assert fixed[["predicted_speedup", "verify_ratio"]].notna().all().all()
    assert speculative.drop(index="fixed", level="k_policy")[["predicted_speedup", "verify_ratio"]].isna().all().all()
    assert fixed["drafted_per_round"].tolist() == [1.0, 3.0]
    # draft_lengths.csv: how many rounds drafted each count, adding up to the summary's drafts and rounds.
    lengths = pd.read_csv(out / "draft_lengths.csv", keep_default_na=False)
    assert tuple(lengths.columns) == schema.DRAFT_LENGTHS
    for (method, k, _, policy), hist in lengths.groupby(["method", "k", "tree", "k_policy"]):
        row = summary.loc[(method, k, policy)]
        assert (hist["drafted"] * hist["rounds"]).sum() == row["drafted"]
        assert hist["rounds"].sum() == row["target_forwards"] - 3
        assert row["drafted_per_round"] == pytest.approx(row["drafted"] / hist["rounds"].sum())
    confident = lengths[(lengths["method"] == "speculative") & (lengths["k_policy"] == "confidence")]
    assert set(confident.loc[confident["k"] == 3, "drafted"]) >= {0, 3}  # it stopped where it was unsure
    heuristic = lengths[(lengths["method"] == "speculative") & (lengths["k_policy"] == "heuristic")]
    assert heuristic["drafted"].nunique() > 1
    assert {(o["method"], o["k_policy"]) for o in outputs(out)} >= {("speculative", "confidence"), ("baseline", "")}
    # On screen: a policy column where one is not fixed, and the policy beside K in the phase table.
    table = shown(summary_table(results.summary, "run"))
    assert "policy" in table and "confidence" in table and "3 heuristic" in shown(phase_table(results.summary))


def test_resume_refuses_another_configuration_and_a_missing_run(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    run(config(tiny_pair, prompts_file, ks=[2], num_prompts=1), out)
    base = ["run", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--dataset", prompts_file, "--num-prompts", "1"]
    one_line_error(cli(*base, "--k", "3", "--out", str(out), "--resume"), "another configuration", "ks")
    one_line_error(cli(*base, "--out", str(tmp_path / "empty"), "--resume"), "no run to resume")
    one_line_error(cli(*base, "--resume"), "--resume needs --out")
    # Without --resume a run never starts over one in its --out: it would overwrite it file by file.
    held = {path.name: path.read_bytes() for path in out.iterdir()}
    one_line_error(cli(*base, "--k", "3", "--out", str(out)), f"{out} holds a run already", "--resume", "remove it")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == held


def test_only_a_run_that_measured_something_is_kept_from_being_replaced(tmp_path):
    # A run that failed before its first record left its meta.json: a corrected rerun must not be stuck on it.
    from specbench.core.errors import SpecbenchError
    from specbench.results.rundir import refuse_to_replace

    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "records.csv").write_text(",".join(schema.RECORDS) + "\n")
    refuse_to_replace(tmp_path)
    (tmp_path / "outputs.jsonl").write_text('{"prompt_id": 0}\n')
    with pytest.raises(SpecbenchError, match="holds a run already: --resume continues it"):
        refuse_to_replace(tmp_path)
    with pytest.raises(SpecbenchError, match="holds a run already: to start over, remove it"):
        refuse_to_replace(tmp_path, resumable=False)  # --method online's learning cannot be resumed


def test_an_unusable_out_directory_fails_before_any_model_is_loaded(tmp_path):
    # The models named do not exist: the directory check must come first.
    result = specbench("run", "--target", "no/such-model", "--out", "/proc/nope", timeout=60)
    one_line_error(result, "cannot write results to /proc/nope", "--out")


def test_the_summary_table_shows_each_speedup_with_its_interval():
    rows = [
        {"method": "baseline", "speedup": 1.0, "speedup_ci": [1.0, 1.0]},
        {"method": "speculative", "k": 4, "speedup": 1.8431, "speedup_ci": [1.6412, 2.0703], "alpha": 0.78},
    ]
    table = shown(summary_table(rows, "run"))
    assert "1.84 (1.64-2.07)" in table and "1.000" in table and "(1.00-1.00)" not in table


def test_the_serving_table_fits_100_columns_and_shows_the_rest_when_wide():
    row = {name: 1.5 for name, _ in report.SERVING} | {"engine": "vllm", "concurrency": 1, "request_rate": math.inf}
    rows = [
        row | {"method": "baseline", "k": None},
        row | {"method": "speculative", "k": 4, "acceptance_source": "response", "tau": 2.4, "failed": 0},
        row | {"method": "speculative", "k": 4, "concurrency": 8, "acceptance_source": "response", "failed": 0},
    ]
    narrow = Console(width=100, record=True)
    narrow.print(serving_table(rows))
    brief = narrow.export_text()
    assert max(map(len, brief.splitlines())) <= 100 and "more columns: --wide" in brief
    header = brief.splitlines()[1]
    assert "conc" in header and "engine" not in header and "c implied" not in brief  # only the load that varies
    wide = shown(serving_table(rows, wide=True))
    assert all(header in wide for _, header in report.SERVING) and "more columns" not in wide


def test_rows_follow_the_schema(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    results = run(config(tiny_pair, prompts_file, ks=[2], methods=["speculative", "prompt-lookup"], num_prompts=1), out)
    assert "policy" not in shown(summary_table(results.summary, "run"))  # every K fixed: nothing to say
    narrow = Console(width=100, record=True)
    narrow.print(summary_table(results.summary, "run"))
    brief = narrow.export_text()
    assert max(map(len, brief.splitlines())) <= 100 and "tok/s" in brief and "alpha" in brief
    assert "base tok/s" not in brief and "--wide" in brief  # the rest: --wide, or summary.csv
    assert "base tok/s" in shown(summary_table(results.summary, "run", wide=True))
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary.columns) == schema.SUMMARY
    # The baseline drafts nothing: no acceptance figures, though its records carry the methods' counts.
    assert summary.loc[0, ["alpha", "acceptance_rate", "tau", "drafted"]].isna().all()
    assert summary.loc[1:, ["alpha", "acceptance_rate", "tau"]].notna().all().all()
    assert list(pd.read_csv(out / "records.csv").columns) == schema.RECORDS
    assert (
        json.loads((out / "meta.json").read_text())["resolved"]["prompts_hash"]
        == pd.read_csv(out / "summary.csv")["prompts_hash"][0]
    )


def test_a_run_without_a_draft_method_loads_no_draft(tiny_pair, prompts_file, tmp_path):
    cfg = config(tiny_pair, prompts_file, draft="/no/such/draft", methods=["prompt-lookup"], ks=[2], num_prompts=1)
    results = run(cfg, tmp_path / "run")
    assert [r["method"] for r in results.summary] == ["baseline", "prompt-lookup"]


def test_the_stop_ids_leave_the_generation_config_alone(tiny_pair):
    import torch

    from specbench.models.load import load

    target = load(tiny_pair[0], torch.device("cpu"), torch.float32)
    target.model.generation_config.eos_token_id = [5, 6]
    assert target.stop_ids == target.stop_ids == frozenset({5, 6, target.tokenizer.eos_token_id})
    assert target.model.generation_config.eos_token_id == [5, 6]


def test_the_methodology_column_table_is_the_schema():
    methodology = (ROOT / "docs" / "methodology.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (\w*) \| (.+) \|$", methodology, flags=re.M)
    want = [(c.name, c.kind, c.better or "", c.meaning) for c in schema.COLUMNS]
    assert rows == want


def test_the_contributing_example_method_is_exact_and_registers(monkeypatch, one_thread):
    from types import ModuleType, SimpleNamespace

    import pytest
    import torch

    from specbench.bench import config
    from specbench.core.errors import SpecbenchError
    from specbench.decoding.decode import autoregressive_decode, speculative_decode
    from specbench.decoding.sampling import Sampling
    from specbench.methods import registry

    from ..toy import P_FLOOR, VOCAB, ToyLM, chi_square_p

    guide = (ROOT / "docs" / "contributing.md").read_text()
    section = guide.split("## Adding a method", 1)[1].split("\n## ", 1)[0]
    drafter_code, method_code = (block.split("```", 1)[0] for block in section.split("```python")[1:3])
    module = ModuleType("specbench.drafters.repeat")  # the drafter's module, as the guide places it
    exec(drafter_code, module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = vars(registry).copy()
    exec(method_code, namespace)
    namespace["RepeatDrafter"] = module.RepeatDrafter
    repeat = namespace["Repeat"]()
    assert isinstance(repeat, registry.SpeculativeLoop) and repeat.name == "repeat"
    # Registered as the guide says, its option is declared once, and the options column and the refusal follow.
    registered = registry.METHODS
    extended = {**registered, repeat.name: repeat} if isinstance(registered, dict) else (*registered, repeat)
    monkeypatch.setattr(config, "METHODS", extended)
    (option,) = repeat.options
    assert config.declared()["repeat_last"] is option and option.default == 1
    assert repeat.options_column(SimpleNamespace(repeat_last=3)) == "repeat_last=3"
    with pytest.raises(SpecbenchError, match="^--repeat-last .*$"):
        option.validate(0)
    assert repeat.drafter(None, SimpleNamespace(repeat_last=3), None, None).last == 3
    # Exact under sampling while it cycles (2 tokens, K=3), and greedy equality.
    drafter = namespace["RepeatDrafter"](2)
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, 3, Sampling(temperature=1.0)) > P_FLOOR
    target, prompt, greedy = ToyLM(5, seed=3), torch.tensor([1, 4]), Sampling(0.0)
    want = autoregressive_decode(target, prompt, 30, greedy, torch.Generator()).tokens
    assert (
        speculative_decode(target, namespace["RepeatDrafter"](3), prompt, 3, 30, greedy, torch.Generator()).tokens
        == want
    )


def test_every_file_a_run_writes_has_exactly_the_schemas_columns(tiny_pair, prompts_file, tmp_path):
    # online (online.csv), a tree (rank rows in acceptance.csv), assumed alphas (predicted.csv).
    cfg = config(
        tiny_pair, prompts_file, methods=["speculative", "online", "tree"], num_prompts=2, assume_alpha=[0.5, 0.7]
    )
    run(cfg, tmp_path)
    written = {path.name for path in tmp_path.iterdir()}
    assert {"summary.csv", "records.csv", "verify_cost.csv", "acceptance.csv", "online.csv", "predicted.csv"} <= written
    for name, columns in schema.FILES.items():
        if name.endswith(".csv") and name in written:
            assert tuple(pd.read_csv(tmp_path / name).columns) == columns, name
    assert all(tuple(line) == schema.OUTPUTS for line in outputs(tmp_path))
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["format"] == schema.RESULTS_FORMAT and document["config"]["methods"] == cfg.methods
    speculative = next(row for row in document["summary"] if row["method"] == "speculative")
    low, high = speculative["speedup_ci"]
    assert low <= speculative["speedup"] <= high and set(speculative) - {f"{m}_ci" for m in schema.RATES} == set(
        schema.SUMMARY
    )


def test_the_phases_are_the_phase_clocks():
    from dataclasses import fields

    from specbench.decoding.timing import Phases

    assert tuple(f"{f.name}_s" for f in fields(Phases)) == schema.PHASES


def test_version_list_and_the_choices_in_help():
    from typer.testing import CliRunner

    from specbench import __version__
    from specbench.cli.app import app

    runner = CliRunner()
    assert runner.invoke(app, ["--version"]).stdout.strip() == f"specbench {__version__}"
    listed = runner.invoke(app, ["list"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0
    for name, method in METHODS.items():
        assert name in listed.stdout and all(option.flag in listed.stdout for option in method.options)
    assert "smollm2-135m-draft" in listed.stdout and "longcode" in listed.stdout and "pydoc" in listed.stdout
    shown = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "250"}).stdout
    for choices in ("[auto|on|off]", "[retrieval|window]"):  # short choices in the value column
        assert choices in shown
    # longer ones in the help text: each option's own words, or "One of" added where they lack them
    dtype = next(line for line in shown.splitlines() if "--dtype" in line)
    assert "NAME" in dtype and all(choice in dtype for choice in ("float32", "bfloat16", "float16"))
    assert "[table|csv]" in runner.invoke(app, ["theory", "--help"], env={"COLUMNS": "250"}).stdout


def test_run_help_is_in_panels_by_purpose_shows_every_default_and_fits_100_columns():
    from typer.testing import CliRunner

    from specbench.cli.app import app

    shown = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "100"}).stdout
    assert max(len(line) for line in shown.splitlines()) <= 100
    for panel in ("What to compare", "Workload", "Decoding", "Timing and repeats", "Output", "Options of online"):
        assert f"╭─ {panel}" in shown
    flat = " ".join(shown.replace("│", " ").split())
    for name, option in OPTIONS.items():  # a flag's default, a list's and a repeatable flag's
        if option.default not in (None, False, "", [], {}, 0):
            default = ", ".join(map(str, option.default)) if isinstance(option.default, list) else option.default
            default = name if option.default is True else default  # Typer shows an on flag by its name
            assert f"[default: {default}]" in flat or f"[default: {option.text_default}]" in flat, name
    # sweep-context's own defaults: one tag each (a hunt saw --method with run's and its own)
    context = " ".join(CliRunner().invoke(app, ["sweep-context", "--help"], env={"COLUMNS": "250"}).stdout.split())
    method = context[context.index("--method") : context.index("--target")]
    assert method.count("[default:") == 1 and "[default: speculative,speculative-window,self-sparse,triforce]" in method


def test_the_options_reference_is_written_from_the_declarations():
    from specbench.cli.flags import REFERENCE, reference
    from specbench.core.options import AUDIT

    written = (ROOT / REFERENCE).read_text()
    assert written == reference(OPTIONS.values(), AUDIT), "run python -m specbench.cli.flags to rewrite it"
    assert all(f"| `{option.flag}` |" in written for option in [*OPTIONS.values(), *AUDIT])


def test_theory_takes_k_as_run_spells_it():
    from typer.testing import CliRunner

    from specbench.cli.app import app

    runner = CliRunner()
    spelled = [
        runner.invoke(app, ["theory", "--alpha", "0.6", "--c", "0.1", flag, "2,4", "--format", "csv"])
        for flag in ("--k", "--ks")
    ]
    assert spelled[0].exit_code == 0 and spelled[0].stdout == spelled[1].stdout
    assert [line.split(",")[2] for line in spelled[0].stdout.splitlines()[1:]] == ["2", "4"]


@pytest.mark.parametrize("graphs", [False, True], ids=["fast", "static"])
def test_before_vllm_loads_its_copy_nothing_of_the_loops_models_stays(
    tiny_pair, prompts_file, tmp_path, monkeypatch, graphs
):
    # On a GPU vLLM starts only where most of the memory is free: the loop's forwards (their own
    # weights, packed or joined), caches, graphs and the methods' views must all be gone by then.
    import gc
    import types
    import weakref

    from specbench.bench import config as config_module
    from specbench.bench import run as run_module

    held = []
    prepared = run_module.prepare

    def prepare(cfg):
        pair, conversations = prepared(cfg)
        for lm in (pair.target_lm, pair.draft_lm):
            held.extend(weakref.ref(x) for x in (lm.fast, lm.fast.embedding, lm.fast.layers[0].gate_up.weights[0]))
            if graphs:
                held.append(weakref.ref(lm.kv.keys[0]))
        return pair, conversations

    def serve_rows(*args, **kwargs):
        gc.collect()
        alive = [ref() for ref in held if ref() is not None]
        assert not alive, [type(x).__name__ for x in alive]
        yield from ()

    monkeypatch.setattr(config_module, "available", lambda: True)
    monkeypatch.setattr(run_module, "prepare", prepare)
    monkeypatch.setattr(
        run_module, "serving_run", lambda cfg, *_: types.SimpleNamespace(baseline=cfg.served_baseline, plan=[])
    )
    monkeypatch.setattr(run_module, "serve_rows", serve_rows)
    cfg = config(
        tiny_pair, prompts_file, methods=["speculative", "speculative-window"], engines=["torch", "vllm"], ks=[2],
        num_prompts=1, graphs=graphs,
    )  # fmt: skip
    results = run(cfg, tmp_path / "out")
    assert {row["method"] for row in results.summary} >= {"baseline", "speculative", "speculative-window"}
    assert len(held) >= 6
    # What ran the loop's forwards is still said, at the end, of models let go before it.
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert set(meta["resolved"]["forward"]) == {"target", "draft"} and results.forward.startswith("target ")
