"""Is the client what is measured? specbench's client (--engine server) and `vllm bench serve`'s,
each against a stub server that streams one token per chunk at a fixed interval and records when it
sent every chunk: each client's TPOT and ITL of each request against the server's own, as the
number of requests in flight grows.

    python benchmarks/client_overhead.py --concurrency 1,4,16,64,128,256 --interval-ms 10 --tokens 128

The stub runs in a process of its own (benchmarks/stub_server.py --record), and so does each client
at each load, one after the other (CLIENTS): `specbench run --engine server` as a user runs it, and
vLLM's (vllm.benchmarks.serve, what `vllm bench serve` runs) under --vllm-python. The truth is the
stub's own send times, so a stub that falls behind at a high load is not counted as the client's
error. Writes OUT/client_overhead.csv, OUT/table.md and OUT/meta.json, and each client's raw record
and the stub's under OUT/raw/.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUB = Path(__file__).resolve().parent / "stub_server.py"
TOLERANCE = 0.05  # the error a level may have and still count as measuring the server
TAG = re.compile(r"#(\d+)")  # how a recording stub begins each answer: its number for the request

# Run as vLLM's `vllm bench serve` runs, minus its command-line wrapper (which fails to start on a
# CPU-only vLLM): its own parser and entry point.
VLLM_CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

COLUMNS = {
    "client": "whose client",
    "concurrency": "requests in flight",
    "requests": "requests measured (matched with the stub's record)",
    "failed": "requests that failed or could not be matched",
    "tokens_per_s": "output tokens per second over the block, as the client reports it",
    "server_itl_p50_ms": "median gap between the stub's sends of successive chunks (its own lateness included)",
    "tpot_err_p50": "median over requests of |client TPOT / server TPOT - 1|",
    "tpot_err_p99": "99th percentile over requests of the same",
    "itl_err_p50": "median over every gap of |client gap / server gap - 1|",
    "itl_err_p99": "99th percentile over every gap of the same",
    "tpot_p50_err": "the client's median TPOT / the server's median TPOT - 1 (signed)",
    "tpot_p99_err": "the same for the 99th percentile of TPOT",
    "itl_p50_err": "the client's median ITL / the server's median ITL - 1 (signed)",
    "itl_p99_err": "the same for the 99th percentile of ITL",
    "tpot_within_5pct": "TPOT within 5%: tpot_err_p50, tpot_err_p99, tpot_p50_err and tpot_p99_err",
    "itl_within_5pct": "ITL within 5%: itl_err_p50 and itl_p50_err",
    "itl_p99_within_5pct": "the reported ITL p99 within 5%: itl_p99_err",
    "load_1m": "the machine's 1-minute load average when the block started",
}


# ---------------------------------------------------------------- the error of one block


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation as numpy's (and specbench.metrics')."""
    if not values:
        return math.nan
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def block_errors(measured: list[dict], sent: dict[int, list[float]]) -> dict:
    """How far one client's record of a block is from the server's.

    ``measured``: a dict per request with ``serial`` (the stub's number, None when unknown), ``itl``
    (s between successive chunks, as the client saw them) and ``tpot`` (s, the client's own figure);
    ``sent``: the stub's send times of each request's chunks, by number. Errors are relative
    (client / server - 1), as fractions; a request that failed, or whose chunks the client did not
    count as the server sent them, is counted in ``failed``."""
    gaps, tpot_errors, client_gaps, true_gaps, client_tpots, true_tpots = [], [], [], [], [], []
    failed = 0
    for request in measured:
        times = sent.get(request["serial"]) if request["serial"] is not None else None
        if times is None or len(times) < 2 or len(request["itl"]) != len(times) - 1 or not request["tpot"] > 0:
            failed += 1
            continue
        truth = [b - a for a, b in zip(times, times[1:], strict=False)]
        gaps += [c / t - 1 for c, t in zip(request["itl"], truth, strict=True)]
        client_gaps += request["itl"]
        true_gaps += truth
        tpot = (times[-1] - times[0]) / (len(times) - 1)
        tpot_errors.append(request["tpot"] / tpot - 1)
        client_tpots.append(request["tpot"])
        true_tpots.append(tpot)
    absolute = lambda values: [abs(v) for v in values]  # noqa: E731
    figure = lambda client, true, q: percentile(client, q) / percentile(true, q) - 1  # noqa: E731
    return {
        "requests": len(measured) - failed,
        "failed": failed,
        "server_itl_p50_ms": 1000 * percentile(true_gaps, 50),
        "tpot_err_p50": percentile(absolute(tpot_errors), 50),
        "tpot_err_p99": percentile(absolute(tpot_errors), 99),
        "itl_err_p50": percentile(absolute(gaps), 50),
        "itl_err_p99": percentile(absolute(gaps), 99),
        "tpot_p50_err": figure(client_tpots, true_tpots, 50),
        "tpot_p99_err": figure(client_tpots, true_tpots, 99),
        "itl_p50_err": figure(client_gaps, true_gaps, 50),
        "itl_p99_err": figure(client_gaps, true_gaps, 99),
    }


# What each verdict asks of a block, beside no failed request: errors at most TOLERANCE. TPOT: each
# request's (to the 99th percentile over requests) and the p50 and p99 a summary reports. ITL: each
# gap's to the median, and the reported median. The reported ITL p99 has a verdict of its own: it is
# the 1% of gaps that a client's wake-up late by a few hundred microseconds already puts 5% off a
# 10 ms gap (the next gap gives it back, so TPOT does not see it).
VERDICTS = {
    "tpot": ("tpot_err_p50", "tpot_err_p99", "tpot_p50_err", "tpot_p99_err"),
    "itl": ("itl_err_p50", "itl_p50_err"),
    "itl_p99": ("itl_p99_err",),
}


def within(row: dict, verdict: str, tolerance: float = TOLERANCE) -> bool:
    """Whether a block's figures of one kind (VERDICTS) are the server's to within ``tolerance``."""
    return row["failed"] == 0 and all(abs(row[name]) <= tolerance for name in VERDICTS[verdict])


def serial_of(text: str) -> int | None:
    found = TAG.match(text or "")
    return int(found.group(1)) if found else None


# ---------------------------------------------------------------- the clients, each in a process of its own

CLIENTS = {
    "specbench": "specbench run --engine server: its client (Server) with the run's own work on each finished request",
    "vllm": "vllm bench serve's client (vllm.benchmarks.serve), --backend openai",
    # Not by default: in a process that imports nothing big, glibc's malloc keeps its default mmap
    # and trim thresholds, and asyncio's 256 KiB socket reads page-fault on every read, which a user
    # never sees: specbench run imports transformers (and vLLM's client vLLM) first, which raises them
    # (docs/servers.md).
    "specbench-server": "specbench.engines.server.Server alone, in a bare process (not run unless named)",
}
DEFAULT_CLIENTS = ("specbench", "vllm")


def server_client(url: str, concurrency: int, count: int, tokens: int, input_len: int, out: str) -> None:
    """Send ``count`` requests through specbench's Server (the --engine server client) and write
    what it measured of each to ``out`` (JSON). Runs in a child process."""
    from specbench.decoding.sampling import Sampling
    from specbench.engines.server import Server

    sampling = Sampling(max_new_tokens=tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=())
    prompts = [[(7 * i + j) % 300 + 1 for j in range(input_len)] for i in range(count)]
    with Server("stub", url) as server:
        began = time.perf_counter()
        served = list(server.run(prompts, concurrency, sampling))
        duration = time.perf_counter() - began
    record = {
        "tokens_per_s": sum(s.count for s in served if not s.error) / duration,
        "requests": [{"serial": serial_of(s.text), "itl": s.itl, "tpot": s.tpot_ms / 1000} for s in served],
    }
    Path(out).write_text(json.dumps(record))


def run_record(out: Path) -> dict:
    """What `specbench run` wrote of its requests (records.csv, outputs.jsonl for each answer's tag):
    the baseline's block and the server's, both this stub at this load, pooled. tokens_per_s: the mean
    of the blocks' throughput in summary.csv."""
    tags = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        output = json.loads(line)
        tags[(output["method"], int(output["prompt_index"]))] = serial_of(output["text"])
    requests = []
    with (out / "records.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            serial = None if row["error"] else tags.get((row["method"], int(row["prompt_index"])))
            itl = [float(gap) / 1000 for gap in row["itl_ms"].split()]
            tpot = float(row["tpot_ms"]) / 1000 if row["tpot_ms"] else math.nan
            requests.append({"serial": serial, "itl": itl, "tpot": tpot})
    with (out / "summary.csv").open(newline="") as f:
        throughputs = [float(row["throughput"]) for row in csv.DictReader(f)]
    return {"tokens_per_s": sum(throughputs) / len(throughputs), "requests": requests}


def vllm_record(path: Path) -> dict:
    """vLLM's saved result (--save-result --save-detailed) as server_client writes its own: its TPOT
    of a request is (latency - ttft) / (output tokens - 1), as its summary computes it."""
    result = json.loads(path.read_text())
    requests = []
    for text, itl, ttft, latency, tokens, error in zip(
        result["generated_texts"], result["itls"], result["ttfts"], result["latencies"], result["output_lens"],
        result["errors"], strict=True,
    ):  # fmt: skip
        tpot = (latency - ttft) / (tokens - 1) if tokens > 1 and not error else math.nan
        requests.append({"serial": serial_of(text) if not error else None, "itl": itl, "tpot": tpot})
    return {"tokens_per_s": result["total_output_tokens"] / result["duration"], "requests": requests}


# ---------------------------------------------------------------- the run


def build_model_dir(path: Path, prompts: int) -> None:
    """What the clients need and no hub gives here: a tiny byte-level BPE tokenizer (vLLM's client
    draws its random prompts with it) and a config beside it (specbench run's --target names a
    checkpoint; a server run loads no weights); and a prompts file for specbench run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)
    LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(path)  # fmt: skip
    lines = (json.dumps({"prompt": f"question {i}: the quick brown fox"}) for i in range(prompts))
    (path / "prompts.jsonl").write_text("\n".join(lines) + "\n")


class StubProcess:
    """benchmarks/stub_server.py --record in a process of its own, for the length of a with block."""

    def __init__(self, interval_ms: float, log: Path):
        self.interval_ms, self.log = interval_ms, log

    def __enter__(self) -> StubProcess:
        command = [sys.executable, str(STUB), "--record", "--interval-ms", str(self.interval_ms)]
        self.errors = self.log.open("w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.errors, text=True)
        self.url = self.process.stdout.readline().strip()
        if not self.url.startswith("http"):
            self.__exit__()
            sys.exit(f"the stub server did not start: see {self.log}")
        self.root = self.url.removesuffix("/v1")
        return self

    def sent(self) -> dict[int, list[float]]:
        """Its send times of the requests finished since the last call (and it forgets them)."""
        with urllib.request.urlopen(self.root + "/stub/sent", timeout=60) as response:
            return {int(serial): times for serial, times in json.load(response).items()}

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.errors.close()


def run_client(client: str, stub: StubProcess, concurrency: int, count: int, args, raw: Path) -> dict:
    """One client's block at one load, in a child process; its record of each request."""
    name = f"{client}-c{concurrency}"
    log, out, model = raw / f"{name}.log", raw / name, args.out / "model"
    budget = 300 + 40 * math.ceil(count / concurrency) * args.tokens * args.interval_ms / 1000
    # The children import specbench (and benchmarks/) from this checkout, not from wherever it is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if client == "specbench":
        shutil.rmtree(out, ignore_errors=True)  # a run refuses to start over another: this benchmark measures anew
        command = [
            sys.executable, "-m", "specbench", "run", "--engine", "server", "--target", str(model),
            "--baseline-url", stub.url, "--server", f"stub={stub.url}", "--dataset", str(model / "prompts.jsonl"),
            "--num-prompts", str(count), "--concurrency", str(concurrency), "--max-new-tokens", str(args.tokens),
            "--warmup", "0", "--out", str(out),
        ]  # fmt: skip
    elif client == "specbench-server":
        call = [stub.url, concurrency, count, args.tokens, args.input_len, str(out.with_suffix(".json"))]
        command = [
            sys.executable,
            "-c",
            f"from benchmarks.client_overhead import server_client; server_client(*{call!r})",
        ]
    else:
        command = [
            args.vllm_python, "-c", VLLM_CLIENT, "--backend", "openai", "--base-url", stub.root,
            "--endpoint", "/v1/completions", "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.tokens), "--random-range-ratio", "0", "--num-prompts", str(count),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", "0",
            "--tokenizer", str(model), "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(raw), "--result-filename", f"{name}.json",
        ]  # fmt: skip
    with log.open("w") as said:
        done = subprocess.run(command, stdout=said, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=budget)
    if done.returncode != 0:
        sys.exit(f"{client}'s client failed at concurrency {concurrency}: see {log}")
    if client == "specbench":
        return run_record(out)
    if client == "specbench-server":
        return json.loads(out.with_suffix(".json").read_text())
    return vllm_record(out.with_suffix(".json"))


def machine() -> dict:
    model = ""
    try:
        said = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in said.splitlines() if line.startswith("Model name")), "")
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "checkout": commit.stdout.strip(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    columns = "\n".join(f"  {name}: {what}" for name, what in COLUMNS.items())
    parser = argparse.ArgumentParser(
        description="The error of specbench's and vLLM's benchmark clients on ITL and TPOT against a stub "
        "server's own send times, by concurrency.",
        epilog=f"OUT/client_overhead.csv has a row per client and load:\n{columns}\n"
        "OUT/table.md is the same as a table, with the machine and the load up to which each client stays "
        "within 5%; OUT/meta.json the machine, the checkout and the load average before and after.",
        formatter_class=Formatter,
    )
    parser.add_argument("--concurrency", default="1,4,16,64,128,256", help="requests in flight, one block per value")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="the stub's pause before each chunk")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request (one per chunk)")
    parser.add_argument(
        "--input-len", type=int, default=16, help="prompt tokens per request (specbench run's: short texts)"
    )
    parser.add_argument(
        "--waves", type=int, default=4, help="requests per block = max(waves x concurrency, --min-requests)"
    )
    parser.add_argument("--min-requests", type=int, default=16, help="the fewest requests in a block")
    parser.add_argument(
        "--clients",
        default=",".join(DEFAULT_CLIENTS),
        help="which clients, in this order at each load: " + "; ".join(f"{k}: {v}" for k, v in CLIENTS.items()),
    )
    parser.add_argument(
        "--vllm-python",
        default=str(ROOT / ".venv-vllm" / "bin" / "python"),
        help="the Python of an environment with vLLM (make install-vllm)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "client-overhead", help="where results go")
    args = parser.parse_args(argv)
    args.levels = [int(n) for n in args.concurrency.split(",")]
    args.client_list = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not set(args.client_list) <= set(CLIENTS) or not args.client_list:
        parser.error(f"--clients: one or more of {', '.join(CLIENTS)}")
    if args.interval_ms <= 0 or args.tokens < 2 or min(args.levels) < 1:
        parser.error("--interval-ms must be above 0, --tokens at least 2, each --concurrency at least 1")
    if "vllm" in args.client_list and not Path(args.vllm_python).exists():
        parser.error(
            f"--vllm-python: {args.vllm_python} does not exist (make install-vllm, or leave vllm out of --clients)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "raw"
    raw.mkdir(exist_ok=True)
    levels = [(concurrency, max(args.waves * concurrency, args.min_requests)) for concurrency in args.levels]
    build_model_dir(args.out / "model", max(count for _, count in levels))
    meta = {**machine(), "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]), "args": {}}
    meta["args"] = {k: str(v) for k, v in vars(args).items() if k not in ("levels", "client_list")}
    meta["load_before"] = os.getloadavg()
    rows = []
    with StubProcess(args.interval_ms, raw / "stub.log") as stub:
        for concurrency, count in levels:
            for client in args.client_list:
                load = os.getloadavg()[0]
                stub.sent()  # forget anything before this block
                record = run_client(client, stub, concurrency, count, args, raw)
                sent = stub.sent()
                (raw / f"{client}-c{concurrency}-sent.json").write_text(json.dumps(sent))
                row = {"client": client, "concurrency": concurrency}
                row.update(block_errors(record["requests"], sent))
                row["tokens_per_s"] = record["tokens_per_s"]
                row.update({f"{verdict}_within_5pct": within(row, verdict) for verdict in VERDICTS})
                row["load_1m"] = load
                rows.append({name: row[name] for name in COLUMNS})
                print(f"{client} at {concurrency} in flight: {row['requests']} requests measured", file=sys.stderr)
    meta["load_after"] = os.getloadavg()
    write(rows, meta, args)


def up_to(rows: list[dict], client: str, verdict: str) -> int | None:
    """The highest concurrency up to which every measured level of ``client`` passes ``verdict``."""
    best = None
    for row in sorted((r for r in rows if r["client"] == client), key=lambda r: r["concurrency"]):
        if not row[f"{verdict}_within_5pct"]:
            break
        best = row["concurrency"]
    return best


def verdict_lines(rows: list[dict], clients: list[str]) -> list[str]:
    names = {"tpot": "TPOT", "itl": "ITL (median)", "itl_p99": "ITL p99"}
    lines = []
    for client in clients:
        said = []
        for verdict, name in names.items():
            n = up_to(rows, client, verdict)
            said.append(f"{name} up to {n} in flight" if n else f"{name} at no load measured")
        lines.append(f"{client} within 5% of the server: " + ", ".join(said))
    return lines


def write(rows: list[dict], meta: dict, args) -> None:
    with (args.out / "client_overhead.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    meta["within_5pct_up_to"] = {
        client: {verdict: up_to(rows, client, verdict) for verdict in VERDICTS} for client in args.client_list
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    headers = ["client", "in flight", "tok/s", "server ITL p50 ms"]
    headers += ["TPOT \\|err\\| p50", "TPOT \\|err\\| p99", "ITL \\|err\\| p50", "ITL \\|err\\| p99"]
    headers += ["TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "within 5%: TPOT, ITL, ITL p99"]
    yes = lambda ok: "yes" if ok else "no"  # noqa: E731
    cells = [
        [
            row["client"], str(row["concurrency"]), f"{row['tokens_per_s']:.0f}", f"{row['server_itl_p50_ms']:.2f}",
            *(f"{100 * row[n]:.1f}%" for n in ("tpot_err_p50", "tpot_err_p99", "itl_err_p50", "itl_err_p99")),
            *(f"{100 * row[n]:+.1f}%" for n in ("tpot_p50_err", "tpot_p99_err", "itl_p50_err", "itl_p99_err")),
            ", ".join(yes(row[f"{v}_within_5pct"]) for v in VERDICTS)
            + (f" ({row['failed']} failed)" if row["failed"] else ""),
        ]
        for row in rows
    ]  # fmt: skip
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    load = f"load average {meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after"
    footer = [f"{meta['cpu']}, {meta['cores']} cores; {load}.", *verdict_lines(rows, args.client_list)]
    (args.out / "table.md").write_text("\n".join(lines) + "\n\n" + "\n".join(f"{line}  " for line in footer) + "\n")
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"client error against the stub's send times ({args.interval_ms:g} ms a token)")
        for header in headers:
            table.add_column(header.replace("\\", ""), justify="left" if header == "client" else "right")
        for c in cells:
            table.add_row(*c)
        console = Console()
        console.width = max(console.width, 200)
        console.print(table)
    except ImportError:
        print("\n".join(lines))
    print("\n".join(footer))
    print(f"written: {args.out / 'client_overhead.csv'}, {args.out / 'table.md'}, {args.out / 'meta.json'}")


if __name__ == "__main__":
    main()
