"""Memory: each decode's peak (records.csv, the summary's most per method), read on the model's device;
an out-of-memory error as one line that keeps the rows measured; models loaded straight onto the device."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from specbench.decoding import timing
from specbench.decoding.timing import PeakMemory
from specbench.models.load import load, placement

from ..helpers import one_line_error

CPU = torch.device("cpu")
TINY_RUN = ("--device", "cpu", "--method", "speculative", "--k", "2", "--max-new-tokens", "6", "--cost-repeats", "2")


def specbench_patched(patch: str, *args, timeout=300):
    """``specbench ARGS`` in a process of its own that first runs ``patch`` (Python source): a test
    changes what the CLI meets without changing the CLI."""
    script = (
        f"import sys\n{patch}\nfrom specbench.cli.app import main\nsys.argv = ['specbench', *sys.argv[1:]]\nmain()\n"
    )
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)


def test_each_decode_records_its_peak_memory_and_the_summary_the_most(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    result = specbench_patched(
        "", "run", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--dataset", prompts_file, *TINY_RUN,
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records, summary = pd.read_csv(out / "records.csv"), pd.read_csv(out / "summary.csv")
    assert (records["peak_memory_mb"] > 0).all()  # the process's resident set, weights included
    most = records.groupby("method")["peak_memory_mb"].max()
    assert summary.set_index("method")["peak_memory_mb"].to_dict() == pytest.approx(most.to_dict(), abs=1)
    source = PeakMemory(CPU).source
    assert json.loads((out / "meta.json").read_text())["resolved"]["peak_memory"] == timing.MEMORY_SOURCES[source]


def test_on_a_cpu_the_peak_is_reset_before_each_decode():
    memory = PeakMemory(CPU)
    if memory.source != "vmhwm":
        pytest.skip("this kernel does not let the process reset its peak resident set")
    memory.reset()
    before = memory.peak()
    held = torch.ones(50_000_000)  # 200 MB, touched
    during = memory.peak()
    del held
    memory.reset()
    assert during - before >= 190e6
    assert memory.peak() < during - 150e6  # the reset forgot the freed tensor


def test_without_a_resettable_peak_the_cpu_reads_the_process_peak(monkeypatch, tmp_path):
    import resource

    monkeypatch.setattr(timing, "CLEAR_REFS", tmp_path / "absent" / "clear_refs")  # cannot be written
    memory = PeakMemory(CPU)
    assert memory.source == "ru_maxrss"
    memory.reset()  # nothing to reset
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert kb * 1024 <= memory.peak() <= (kb + 1024) * 1024


def test_on_cuda_the_peak_is_the_allocators_on_the_models_device(monkeypatch):
    """CUDA is initialised first: in a process that has not touched the GPU yet, the allocator has no
    counters to reset (an H200 said "Invalid device argument" to a test that ran first in its worker)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "init", lambda: asked.append(("init",)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: asked.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: asked.append(("peak", device)) or 7)
    second = torch.device("cuda", 1)
    memory = PeakMemory(second)
    memory.reset()
    assert memory.peak() == 7 and asked == [("init",), ("reset", second), ("peak", second)]


@pytest.mark.gpu
def test_on_a_gpu_the_peak_holds_what_a_decode_allocated():
    """Only a GPU has an allocator to read: 256 MB held between reset and peak show, and are forgotten
    at the next reset once freed."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    memory = PeakMemory(device)
    memory.reset()
    before = memory.peak()
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    during = memory.peak()
    del held
    memory.reset()
    assert during - before >= 256 * 2**20 and memory.peak() < during


OUT_OF_MEMORY = """
import torch
from specbench.engines.loop import Loop
from specbench.models.lm import HFCausalLM

real, decodes = Loop.decode, []


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.23 GiB "
        "is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the allocated memory ..."
    )


def decode(self, *args, **kwargs):
    decodes.append(self.decoder.method.name)
    if len(decodes) > 2:  # the first prompt's baseline and speculative went through; the next forward runs out
        HFCausalLM._forward = out_of_memory
    return real(self, *args, **kwargs)


Loop.decode = decode
"""


def test_out_of_memory_is_one_line_naming_the_options_and_keeps_the_rows(tiny_pair, prompts_file, tmp_path):
    out = tmp_path / "run"
    result = specbench_patched(
        OUT_OF_MEMORY, "run", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--dataset", prompts_file,
        *TINY_RUN, "--warmup", "0", "--out", str(out),
    )  # fmt: skip
    one_line_error(
        result, "out of memory", "Tried to allocate 2.00 GiB", "--dtype", "--max-new-tokens", "--prefill-chunk",
        "--device-map", "--k", "--method",
    )  # fmt: skip
    assert result.returncode == 2
    records = pd.read_csv(out / "records.csv")
    assert records[["prompt_index", "method"]].values.tolist() == [[0, "baseline"], [0, "speculative"]]
    assert pd.read_csv(out / "summary.csv")["num_prompts"].tolist() == [1, 1]


# ---------------------------------------------------------------- loading onto the device


def test_a_checkpoint_is_loaded_straight_onto_the_device(tiny_pair, monkeypatch):
    """from_pretrained is given the device, so the weights are read onto it, never first into host
    memory whole; on the CPU the model works as before, its RoPE frequencies float32 in bfloat16 too."""
    from transformers import AutoModelForCausalLM

    asked, real = [], AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        asked.append(kwargs.get("device_map"))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    loaded = load(tiny_pair[0], CPU, torch.bfloat16)
    assert asked == [{"": CPU}]
    assert {p.device for p in loaded.model.parameters()} == {CPU} and loaded.model.dtype == torch.bfloat16
    assert placement(loaded.model) == {"": "cpu"}  # what meta.json records with --device-map
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32  # transformers keeps its own in float32
    load(tiny_pair[0], CPU, torch.float32, device_map="auto")
    assert asked[-1] == "auto"  # accelerate's placement is passed as it was given


def test_a_decodes_peak_is_counted_after_the_caches_of_the_decode_before_are_gone(tiny_pair, monkeypatch):
    # The baseline never touches the draft: the cache a speculative decode left in it must not count
    # in the baseline's peak memory, nor the target's last cache in the next decode's, nor the cache
    # of the window draft that speculative-window keeps from one prompt to the next.
    from specbench.decoding.sampling import Sampling
    from specbench.engines.loop import Loop, Settings
    from specbench.methods.base import Decoder
    from specbench.methods.registry import BASELINE, METHODS
    from specbench.models.load import Wanted
    from specbench.models.pair import load_pair

    pair = load_pair(Wanted(tiny_pair[0], tiny_pair[1], "cpu", "float32"))
    window = Decoder(METHODS["speculative-window"], k=2)
    options = {"draft_window": 8}
    window.method.begin_run(pair, Settings(6, Sampling(), options), window)
    held, prompt, settings = [], torch.tensor([5, 9, 14, 5, 9, 14, 3]), Settings(6, Sampling())

    def lengths(self):
        held.append((pair.target_lm.length, pair.draft_lm.length, window.state.length))

    monkeypatch.setattr(PeakMemory, "reset", lengths)
    Loop(pair, Decoder(METHODS["speculative"], k=2)).decode(prompt, 0, settings, seed=0)
    assert pair.target_lm.length > 0 and pair.draft_lm.length > 0  # what the decode left in the caches
    Loop(pair, window, options).decode(prompt, 0, Settings(6, Sampling(), options), seed=0)
    Loop(pair, Decoder(BASELINE)).decode(prompt, 0, settings, seed=0)
    assert held == [(0, 0, 0)] * 3


def test_a_cuda_device_past_those_torch_sees_is_one_line_naming_them(monkeypatch):
    from specbench.core.errors import SpecbenchError
    from specbench.models.load import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(
        SpecbenchError, match=r"--device cuda:2 asked for, but torch sees 2 CUDA devices \(cuda:0 to cuda:1"
    ):
        resolve_device("cuda:2")


def test_mps_where_torch_sees_none_is_one_line(monkeypatch):
    from specbench.core.errors import SpecbenchError
    from specbench.models.load import resolve_device

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(SpecbenchError, match="--device mps asked for, but torch sees no MPS device"):
        resolve_device("mps")
