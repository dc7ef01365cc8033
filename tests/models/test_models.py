"""Choosing how models load: the dtype --dtype auto picks on each device, a hub model that cannot
be had (gated, missing), and a weights or GGUF file that cannot be read (cut short, not a model), each as
one line naming the model or file and the fix."""

import logging
import shutil
import sys

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from specbench.core.errors import SpecbenchError
from specbench.models.load import gguf_problem, load, resolve_dtype

from ..helpers import cli, one_line_error

CUDA = torch.device("cuda", 1)


def gpu_of_capability(monkeypatch, major: int, minor: int) -> list:
    """torch answering for a GPU of that compute capability, without one; returns the devices asked about."""
    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (major, minor))
    return asked


def test_auto_picks_float16_where_the_gpu_has_no_native_bfloat16(monkeypatch, caplog):
    asked = gpu_of_capability(monkeypatch, 7, 5)  # a T4
    with caplog.at_level(logging.INFO, logger="specbench"):
        assert resolve_dtype("auto", CUDA) == torch.float16
    assert asked and all(device == CUDA for device in asked)  # the run's GPU, not the current one
    [line] = [r.getMessage() for r in caplog.records]
    assert "cuda:1" in line and "7.5" in line and "float16" in line
    assert resolve_dtype("bfloat16", CUDA) == torch.bfloat16  # asked for by name: as asked


def test_auto_picks_bfloat16_on_an_ampere_gpu_and_float32_on_the_cpu(monkeypatch, caplog):
    gpu_of_capability(monkeypatch, 8, 0)
    with caplog.at_level(logging.INFO, logger="specbench"):
        assert resolve_dtype("auto", CUDA) == torch.bfloat16
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert not caplog.records


def hub_error(cls, message: str):
    """``cls`` as huggingface_hub raises it: with a response of the HTTP client it uses."""
    from huggingface_hub import errors

    client = sys.modules[errors.Response.__module__.split(".")[0]]
    request = client.Request("GET", "https://huggingface.co/api/models/org/name")
    return cls(message, response=errors.Response(401, request=request))


@pytest.mark.parametrize(
    "error, needles",
    [
        ("GatedRepoError", ["org/llama-gated is gated", "hf auth login", "HF_TOKEN", "huggingface.co/org/llama-gated"]),
        ("RepositoryNotFoundError", ["org/llama-gated is not on the Hugging Face hub", "check the name", "HF_TOKEN"]),
    ],
)
def test_a_hub_model_that_cannot_be_had_is_one_line(monkeypatch, error, needles):
    import huggingface_hub
    from huggingface_hub import errors

    def snapshot_download(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise errors.LocalEntryNotFoundError(f"{repo_id} is not in the cache")
        raise hub_error(getattr(errors, error), f"401 Client Error for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("specbench.core.environment.hub_reachable", lambda: True)
    with pytest.raises(SpecbenchError) as raised:
        load("org/llama-gated", torch.device("cpu"), torch.float32)
    said = str(raised.value)
    assert "\n" not in said and all(needle in said for needle in needles), said


@pytest.mark.parametrize("damage", ["cut short", "not weights", "a cut zip"])
def test_a_weights_file_that_cannot_be_read_is_one_line_naming_it(tiny_pair, prompts_file, tmp_path, damage):
    """Issue 73: the tiny target's model.safetensors cut to 5,000 bytes (an interrupted download) ended in
    a 73-line traceback. Refused in one line that names the file and says to download it again, exit 2,
    with no run folder left behind."""
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    weights = target / "model.safetensors"
    if damage == "cut short":
        weights.write_bytes(weights.read_bytes()[:5000])
    elif damage == "not weights":
        weights.write_text("<html><body>404 Not Found</body></html>")  # a download that fetched an error page
    else:  # PyTorch's zip format, cut short
        weights.unlink()
        weights = target / "pytorch_model.bin"
        torch.save({"x": torch.zeros(4096)}, weights)
        weights.write_bytes(weights.read_bytes()[:5000])
    out = tmp_path / "run"
    result = cli("run", "--target", target, "--draft", tiny_pair[1], "--dataset", prompts_file, "--out", out)
    one_line_error(result, f"the weights file {weights}:", "download it again")
    assert result.returncode == 2 and not out.exists()


def test_a_gguf_file_cut_short_or_not_gguf_is_one_line_naming_it(prompts_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    whole = tmp_path / "whole.gguf"
    writer = GGUFWriter(str(whole), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut, other = tmp_path / "cut.gguf", tmp_path / "notes.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    other.write_text("not a model")
    assert gguf_problem(whole) is None
    for file in (cut, other):
        out = tmp_path / "run"
        result = cli("run", "--target", file, "--method", "baseline", "--dataset", prompts_file, "--out", out)
        one_line_error(result, f"the GGUF file {file}:", "download it again")
        assert result.returncode == 2 and not out.exists()
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing converted


def test_a_sliding_window_that_sequences_outgrow_is_one_line_and_one_they_fit_decodes(
    tiny_pair, prompts_file, tmp_path
):
    """A hunt found Mistral with a sliding window (7B v0.1's kind) running on transformers' forward until a
    sequence passed the window, then a traceback from the cache's crop: a sliding cache has dropped what a
    rejected draft needs back. Refused before anything is measured; sequences within the window decode."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=48,
    )  # fmt: skip
    model = tmp_path / "mistral"
    MistralForCausalLM(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    args = ["run", "--target", model, "--draft", model, "--dataset", prompts_file, "--chat", "off", "--k", "2"]
    out = tmp_path / "long"
    one_line_error(
        cli(*args, "--max-new-tokens", "60", "--out", out), "sliding window of 48 tokens", "--max-new-tokens"
    )
    assert not (out / "records.csv").exists()
    fits = cli(*args, "--max-new-tokens", "8", "--out", tmp_path / "fits")
    assert fits.returncode == 0, fits.stderr
    assert "greedy outputs: every method equals the baseline" in fits.stdout
    # on transformers' forward, as the run's last lines say (its reason was logged at load)
    said = " ".join(fits.stdout.split())
    assert "forward: target eager (transformers' forward), draft eager (transformers' forward)" in said
