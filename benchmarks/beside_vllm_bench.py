"""specbench's report beside `vllm bench serve`'s, on the same vLLM servers and the same prompts.

    .venv-vllm/bin/python benchmarks/beside_vllm_bench.py --concurrency 1,4,16 --per-category 2

Starts vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server; the `vllm` command fails
on the CPU package) four times on loopback: the default target alone (the baseline), with the shipped
draft at K = 2 and K = 4, and with n-gram lookup at K = 4. All four stay up for the whole run; only
one is sent requests at a time, so they do not share the cores while measured. At each load
`specbench run --engine server` measures all four, then vLLM's own client (vllm.benchmarks.serve,
what `vllm bench serve` runs) measures each of them, on the same prompts: Spec-Bench's first turns,
--per-category of each category, rendered once with the target's chat template and sent as text to
/v1/completions by both in the file's order (vLLM's client shuffles unless told not to, and at a
load above one the order decides which requests share a batch), greedy, at most --max-new-tokens each.

Writes OUT/beside.csv and OUT/table.md (each tool's acceptance rate, acceptance length, mean and
median TPOT, output throughput, per server and load), OUT/prompts.jsonl, and each tool's raw output
under OUT/raw/.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.client_overhead import VLLM_CLIENT  # noqa: E402
from specbench.engines.launch import launched  # noqa: E402
from specbench.models.load import local_dir, resolve, tokenizer_in  # noqa: E402
from specbench.workloads import prompts  # noqa: E402

SERVE = (
    "{python} -m vllm.entrypoints.openai.api_server --port {{port}} --host 127.0.0.1 --enforce-eager "
    "--dtype float32 --seed 0 --max-model-len 2048 --no-enable-prefix-caching --max-num-seqs 16 --model {target}"
)
SPECULATING = {  # name -> vLLM's --speculative-config (each such server also reports per-request acceptance)
    "draft-k2": {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 2},
    "draft-k4": {"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 4},
    "ngram-k4": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4},
}
COLUMNS = {
    "server": "the server (baseline: the target alone)",
    "concurrency": "requests in flight",
    "tool": "whose client and report",
    "requests": "requests that completed",
    "output_tokens": "output tokens over the block",
    "accepted": "accepted draft tokens over the block",
    "divisor": "what acceptance_length divides by: vLLM's drafts (steps that proposed tokens); specbench's target forwards",
    "acceptance_rate": "accepted / drafted tokens over the block",
    "acceptance_length": "vLLM: 1 + accepted / drafts; specbench (tau): output tokens / target forwards",
    "tpot_mean_ms": "mean over requests of (end-to-end - TTFT) / (output tokens - 1)",
    "tpot_p50_ms": "median over requests of the same",
    "output_tok_s": "output tokens per second over the block",
    "acceptance_source": "where the acceptance came from",
}


def workload(out: Path, target: Path, per_category: int, seed: int) -> Path:
    """Spec-Bench's first turns, per_category of each category, rendered with the target's template."""
    tokenizer = tokenizer_in(target)
    picked = prompts.select(prompts.read_dataset("spec-bench"), "spec-bench", [], per_category, seed)
    path = out / "prompts.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for p in picked:
            messages = [{"role": "user", "content": p.turns[0]}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            f.write(json.dumps({"prompt": text, "category": p.category, "id": p.id}) + "\n")
    return path


def specbench_block(
    urls: dict[str, str], workload_path: Path, concurrency: int, count: int, args, raw: Path
) -> list[dict]:
    """One `specbench run --engine server` over every server at this load: its summary rows."""
    out = raw / f"specbench-c{concurrency}"
    shutil.rmtree(out, ignore_errors=True)  # a run refuses to start over another: this benchmark measures anew
    servers = [f"--server={name}={url}" for name, url in urls.items() if name != "baseline"]
    command = [
        sys.executable, "-m", "specbench", "run", "--engine", "server", "--target", str(args.target),
        "--baseline-url", urls["baseline"], *servers, "--dataset", str(workload_path), "--chat", "off",
        "--num-prompts", str(count), "--concurrency", str(concurrency), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out),
    ]  # fmt: skip
    with (raw / f"specbench-c{concurrency}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=True)
    records = list(csv.DictReader((out / "records.csv").open()))
    rows = []
    for row in csv.DictReader((out / "summary.csv").open()):
        tpots = [
            float(r["tpot_ms"]) for r in records if r["method"] == row["method"] and r["tpot_ms"] not in ("", "nan")
        ]
        rows.append({
            "server": row["method"], "concurrency": concurrency, "tool": "specbench", "requests": row["num_prompts"],
            "output_tokens": row["new_tokens"],
            "accepted": row["accepted"], "divisor": row["target_forwards"], "acceptance_rate": row["acceptance_rate"],
            "acceptance_length": row["tau"], "tpot_mean_ms": sum(tpots) / len(tpots) if tpots else "",
            "tpot_p50_ms": row["tpot_p50_ms"], "output_tok_s": row["throughput"],
            "acceptance_source": row["acceptance_source"],
        })  # fmt: skip
    return rows


def vllm_block(name: str, url: str, workload_path: Path, concurrency: int, count: int, args, raw: Path) -> dict:
    """vLLM's own client against one server at this load: its report, as it writes it."""
    result = f"vllm-{name}-c{concurrency}.json"
    command = [
        args.vllm_python, "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", url.removesuffix("/v1"),
        "--endpoint", "/v1/completions", "--dataset-name", "custom", "--dataset-path", str(workload_path), "--disable-shuffle",
        "--skip-chat-template", "--custom-output-len", str(args.max_new_tokens), "--num-prompts", str(count),
        "--max-concurrency", str(concurrency), "--temperature", "0", "--seed", "0", "--tokenizer", str(args.target),
        "--disable-tqdm", "--save-result", "--result-dir", str(raw), "--result-filename", result,
    ]  # fmt: skip
    with (raw / result.replace(".json", ".log")).open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=True)
    said = json.loads((raw / result).read_text())
    rate = said.get("spec_decode_acceptance_rate")
    return {
        "server": name, "concurrency": concurrency, "tool": "vllm bench serve", "requests": said.get("completed"),
        "output_tokens": said.get("total_output_tokens"), "accepted": said.get("spec_decode_accepted_tokens", ""),
        "divisor": said.get("spec_decode_num_drafts", ""),
        "acceptance_rate": "" if rate is None else rate / 100, "acceptance_length": said.get("spec_decode_acceptance_length", ""),
        "tpot_mean_ms": said.get("mean_tpot_ms"), "tpot_p50_ms": said.get("median_tpot_ms"),
        "output_tok_s": said.get("output_throughput"), "acceptance_source": "counters" if rate is not None else "",
    }  # fmt: skip


def rounded(value, places: int = 3) -> str:
    try:
        if value in ("", None):
            return ""
        number = float(value)
        return str(int(number)) if number.is_integer() else f"{number:.{places}g}"
    except ValueError:
        return str(value)


def table(rows: list[dict]) -> str:
    shown = [c for c in COLUMNS if c != "acceptance_source"]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        lines.append(
            "| " + " | ".join(rounded(row[c]) if c not in ("server", "tool") else row[c] for c in shown) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16", help="requests in flight, comma-separated")
    parser.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions of each category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="of the per-category pick")
    parser.add_argument("--target", type=Path, default=None, help="the target's directory (default: smollm2-135m)")
    parser.add_argument("--draft", type=Path, default=None, help="the draft's directory (default: the shipped one)")
    parser.add_argument("--vllm-python", default=sys.executable, help="the Python that has vLLM")
    parser.add_argument("--out", type=Path, default=Path("results/beside-vllm-bench"))
    args = parser.parse_args()
    args.target = args.target or local_dir(resolve("smollm2-135m"))
    args.draft = args.draft or local_dir(resolve("smollm2-135m-draft"))
    raw = args.out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    workload_path = workload(args.out, args.target, args.per_category, args.seed)
    count = sum(1 for _ in workload_path.open())
    serve = SERVE.format(python=args.vllm_python, target=args.target)
    commands = {"baseline": serve}
    for name, spec in SPECULATING.items():
        config = json.dumps({k: v.format(draft=args.draft) if isinstance(v, str) else v for k, v in spec.items()})
        commands[name] = f"{serve} --per-request-spec-decode-metrics detailed --speculative-config '{config}'"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows: list[dict] = []
    with ExitStack() as servers:
        urls = {name: servers.enter_context(launched(name, command, raw)) for name, command in commands.items()}
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            rows += specbench_block(urls, workload_path, concurrency, count, args, raw)
            for name, url in urls.items():
                rows.append(vllm_block(name, url, workload_path, concurrency, count, args, raw))
            rows.sort(key=lambda r: (r["concurrency"], list(urls).index(r["server"]), r["tool"]))
            with (args.out / "beside.csv").open("w", newline="") as f:  # written as each load completes
                writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
                writer.writeheader()
                writer.writerows(rows)
            (args.out / "table.md").write_text(table(rows))
    print(table(rows))
    print(f"results in {args.out}/ (beside.csv, table.md, raw/)")


if __name__ == "__main__":
    main()
