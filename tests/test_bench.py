"""The benchmark as a whole on tiny local models: K lists, random streams, resume, the schema."""

import json
import re
from pathlib import Path

import pandas as pd

from specbench import bench, schema
from specbench.bench import BenchConfig, Results
from specbench.methods import METHODS

from .test_pipeline import on_tiny_pair, one_line_error, specbench

ROOT = Path(__file__).parent.parent


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
    return [event for event in bench.benchmark(cfg, out, resume) if isinstance(event, Results)][0]


def outputs(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


def test_a_k_list_sweeps_and_writes_best_k_and_the_plot(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    result = on_tiny_pair(
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


def test_an_interrupted_run_resumes_without_measuring_anything_twice(tiny_pair, prompts_file, tmp_path):
    cfg, out = config(tiny_pair, prompts_file, methods=["speculative", "prompt-lookup"], ks=[1, 3]), tmp_path / "run"
    events = bench.benchmark(cfg, out)
    for event in events:  # interrupt in the middle of the second prompt
        if event.stage == "decoding" and event.done == 5 + 2:
            break
    events.close()
    first = pd.read_csv(out / "records.csv")
    assert sorted(first["prompt_index"].unique()) == [0, 1]  # prompt 1 is incomplete

    results = run(cfg, out, resume=True)
    records = pd.read_csv(out / "records.csv")
    assert sorted(records.groupby(["prompt_index", "method", "k"], dropna=False).size().tolist()) == [1] * 3 * 5
    kept = first[first["prompt_index"] == 0].reset_index(drop=True)
    pd.testing.assert_frame_equal(records[records["prompt_index"] == 0].reset_index(drop=True), kept)  # timings too
    assert sorted((o["prompt_index"], o["method"], o["k"] or 0) for o in outputs(out)) == sorted(
        {(i, m, k) for i in range(3) for m, k in [("baseline", 0), *[(m, k) for m in cfg.methods for k in cfg.ks]]}
    )
    assert [r["num_prompts"] for r in results.summary] == [3] * 5


def test_resume_refuses_another_configuration_and_a_missing_run(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    run(config(tiny_pair, prompts_file, ks=[2], num_prompts=1), out)
    base = ["run", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--dataset", prompts_file, "--num-prompts", "1"]
    one_line_error(specbench(*base, "--k", "3", "--out", str(out), "--resume"), "another configuration", "ks")
    one_line_error(specbench(*base, "--out", str(tmp_path / "empty"), "--resume"), "no run to resume")
    one_line_error(specbench(*base, "--resume"), "--resume needs --out")


def test_an_unusable_out_directory_fails_before_any_model_is_loaded(tmp_path):
    # The models named do not exist: the directory check must come first.
    result = specbench("run", "--target", "no/such-model", "--out", "/proc/nope", timeout=60)
    one_line_error(result, "cannot write results to /proc/nope", "--out")


def test_rows_follow_the_schema(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    run(config(tiny_pair, prompts_file, ks=[2], methods=["speculative", "prompt-lookup"], num_prompts=1), out)
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

    from specbench.models import load

    target = load(tiny_pair[0], torch.device("cpu"), torch.float32)
    target.model.generation_config.eos_token_id = [5, 6]
    assert target.stop_ids == target.stop_ids == frozenset({5, 6, target.tokenizer.eos_token_id})
    assert target.model.generation_config.eos_token_id == [5, 6]


def test_no_module_but_methods_compares_method_names():
    names = "|".join(re.escape(name) for name in METHODS)
    comparison = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    for path in (ROOT / "specbench").glob("*.py"):
        if path.name != "methods.py":
            assert not comparison.search(path.read_text()), f"{path.name} special-cases a method by name"


def test_the_readme_column_table_is_the_schema():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (\w*) \| (.+) \|$", readme, flags=re.M)
    want = [(c.name, c.kind, c.better or "", c.meaning) for c in schema.COLUMNS]
    assert rows == want


def test_the_readme_example_method_is_exact_and_registers(monkeypatch):
    import torch

    from specbench import methods
    from specbench.engine import autoregressive_decode, speculative_decode
    from specbench.sampling import SamplingConfig

    from .test_lossless import P_FLOOR, VOCAB, chi_square_p
    from .toy import ToyLM

    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Adding a method", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))
    namespace = vars(methods).copy()
    exec(example, namespace)
    assert "repeat" in namespace["METHODS"]
    drafter = namespace["RepeatDrafter"]()
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, 2, SamplingConfig(temperature=1.0)) > P_FLOOR
    target, prompt, greedy = ToyLM(5, seed=3), torch.tensor([1, 4]), SamplingConfig(0.0)
    want = autoregressive_decode(target, prompt, 30, greedy, torch.Generator()).tokens
    assert (
        speculative_decode(target, namespace["RepeatDrafter"](), prompt, 3, 30, greedy, torch.Generator()).tokens
        == want
    )
