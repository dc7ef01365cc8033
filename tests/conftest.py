"""Fixtures: tiny models built locally (no hub), a prompts file, one torch thread, and the guard
that keeps test runs out of the checkout's results/ directory."""

import json
import os
from pathlib import Path

import pytest
import torch

from .helpers import (
    CORPUS,
    build_llama,
    build_thinking_pair,
    build_tokenizer,
    cache_with_default_target,
    spec_bench_rows,
    write_jsonl,
)

RESULTS = Path(__file__).parent.parent / "results"


def _listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")} if directory.is_dir() else set()


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first, and tests marked gpu only where torch sees a CUDA device.

    Why slow first: a long test collected late (the audit's, 2 minutes) ran alone at the end while
    the other worker sat idle. Started first, the long tests run side by side, and at the end a worker
    that runs out takes short tests from the other's queue (pyproject's --dist worksteal)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: each group keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def on_the_cpu(request, monkeypatch):
    """Every test not marked gpu runs on the CPU, on a GPU runner too: `--device auto` and accelerate's
    placement would take a GPU there (bfloat16, torch.compile), and tests asserting equal greedy outputs
    or a CPU placement would then fail. CUDA_VISIBLE_DEVICES hides the GPUs from the CLI's subprocesses;
    in this process torch may already have seen them, so it is told there are none."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session", autouse=True)
def threads_per_worker():
    """xdist's workers share the cores, and torch starts one thread per core in each of them: on 2
    cores, 2 workers ran 4 OpenMP threads that spin while they wait for each other. Each worker
    gets its share of the cores instead (at least one), and so do the CLI's subprocesses it starts,
    through OMP_NUM_THREADS (unless it is set): the GPU check's dry run took 147 s beside one busy
    core with torch's two threads, 81 s with one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.fixture(scope="session", autouse=True)
def nothing_written_to_results():
    """Fails the session if a test left new entries under the checkout's results/: a `specbench run`
    without --out writes there (results/<time>-<target>-<draft>/), and every run a test starts
    belongs under its tmp_path. Each xdist worker checks across its own tests."""
    before = _listing(RESULTS)
    yield
    if new := sorted(_listing(RESULTS) - before):
        pytest.fail(f"tests wrote into {RESULTS}: {', '.join(new[:10])}; pass --out under tmp_path")


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the exactness tests decode tiny tensors thousands of times,
    where intra-op threads only add wake-up latency (10x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """(target dir, draft dir): a 4-layer and a 1-layer random Llama sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer(root / "tok")
    target = build_llama(root / "target", tokenizer, layers=4, hidden=64, seed=0)
    draft = build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=1)
    return str(target), str(draft)


@pytest.fixture(scope="session")
def thinking_pair(tmp_path_factory) -> tuple[str, str, str]:
    """(target dir, draft dir, prompts file) of a pair whose vocabulary holds <think> and </think> and
    whose target closes its thinking part-way (helpers.build_thinking_pair)."""
    return build_thinking_pair(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="session")
def untied_target(tiny_pair, tmp_path_factory) -> str:
    """A target for tiny_pair's draft that the draft mostly mispredicts under greedy. A random model
    with tied embeddings repeats its last token, as the tiny draft does; an untied one writes varied
    text, so a draft has something to learn from it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    return str(
        build_llama(tmp_path_factory.mktemp("untied") / "target", tokenizer, layers=4, hidden=64, seed=0, tie=False)
    )


@pytest.fixture(scope="session")
def padded_draft(tiny_pair, tmp_path_factory) -> str:
    """A draft for tiny_pair's target whose embedding matrix is padded 16 rows wider, as model
    families with one tokenizer often are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    return str(
        build_llama(tmp_path_factory.mktemp("padded") / "draft", tokenizer, layers=1, hidden=32, seed=1, vocab_pad=16)
    )


@pytest.fixture(scope="session")
def foreign_draft(tmp_path_factory) -> str:
    """A draft whose tokenizer has the same size as tiny_pair's but different contents."""
    root = tmp_path_factory.mktemp("foreign")
    tokenizer = build_tokenizer(root / "tok", seed_text=["SELECT * FROM t WHERE x = 1;\n"] * 50 + CORPUS[:4])
    return str(build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=2))


@pytest.fixture(scope="session")
def llama_cache(tmp_path_factory) -> Path:
    """specbench's cache for the session (SPECBENCH_CACHE: the default target read from its GGUF, and
    GGUF conversions), under the tests' temporary root. The llama.cpp tests share it, so that each
    conversion (SmolLM2-135M to f32 took 12 s, the shipped draft 11 s) is made once a session; the
    default target's float32 copy is the user cache's (cache_with_default_target)."""
    return cache_with_default_target(tmp_path_factory.mktemp("specbench-cache"))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = ["def square(x):\n", "class Stack:\n    def push(self, item):\n", "for k in range(3):\n"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    return str(path)


@pytest.fixture(scope="session")
def spec_bench_file(tmp_path_factory):
    """A question.jsonl of Spec-Bench's shape (helpers.spec_bench_rows)."""
    return str(write_jsonl(tmp_path_factory.mktemp("spec") / "question.jsonl", spec_bench_rows()))
