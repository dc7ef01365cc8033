"""Who writes distill's answers (--teacher-engine): llama-server's replies and vLLM's outputs read into
the same shards the torch target writes, and another engine's answers refused unless they come from
the target's weights. The llama.cpp runs need `make install-llama-cpp` (marker llama_cpp, as
test_llama_cpp.py); vLLM's run is in test_vllm.py."""

import json
from pathlib import Path

import pytest
import torch

from specbench.core.errors import SpecbenchError
from specbench.engines import Served, llamacpp
from specbench.engines import vllm as vllm_engine
from specbench.models.load import load
from specbench.models.names import resolve
from specbench.training.distill import DistillConfig
from specbench.training.teacher import (
    MAX_LOGP_DIFFERENCE,
    MIN_AGREEMENT,
    agreement,
    parsed_completion,
    same_weights,
    served_answer,
    torch_answers,
    weights_check,
)

from ..helpers import cli, one_line_error

CPU, F32 = torch.device("cpu"), torch.float32


def position(token: int, tops: list[tuple[int, float]]) -> dict:
    return {"id": token, "token": f"<{token}>", "logprob": dict(tops).get(token, -9.0), "top_logprobs": [
        {"id": i, "token": f"<{i}>", "logprob": lp} for i, lp in tops
    ]}  # fmt: skip


def test_a_llama_server_reply_becomes_an_answer_through_its_first_stop_token():
    reply = {
        "tokens": [5, 2, 8],
        "completion_probabilities": [
            position(5, [(7, -2.0), (5, -0.5), (9, -1.5)]),  # listed out of order: sorted, likeliest first
            position(2, [(2, -0.1), (5, -3.0), (7, -4.0)]),  # the stop token: kept
            position(8, [(8, -0.2), (1, -2.0), (3, -3.0)]),  # after it: dropped
        ],
    }
    answer = parsed_completion(reply, top_k=2, stop={2})
    assert answer.tokens == [5, 2] and answer.dropped == 0
    assert answer.top_idx.tolist() == [[5, 9], [2, 5]] and answer.top_idx.dtype == torch.int32
    assert answer.top_logp.dtype == torch.float16
    torch.testing.assert_close(answer.top_logp.float(), torch.tensor([[-0.5, -1.5], [-0.1, -3.0]]), atol=1e-3, rtol=0)
    empty = parsed_completion({"tokens": [], "completion_probabilities": []}, top_k=2, stop={2})
    assert empty.tokens == [] and empty.top_idx.shape == (0, 2)
    with pytest.raises(SpecbenchError, match="lower --top-k"):
        parsed_completion(reply, top_k=4, stop={2})


def test_an_answer_ends_where_llama_server_gives_a_token_no_probabilities():
    """llama-server lists no entry for a token that ends inside a multi-byte character (the next
    entry is the completing token's): from there positions and probabilities no longer line up."""
    reply = {
        "tokens": [5, 40, 41, 6, 2],  # 40 is the first half of a character that 41 completes
        "completion_probabilities": [
            position(5, [(5, -0.1), (6, -3.0)]),
            position(41, [(41, -0.2), (6, -2.0)]),
            position(6, [(6, -0.3), (5, -2.0)]),
            position(2, [(2, -0.1), (5, -3.0)]),
        ],
    }
    answer = parsed_completion(reply, top_k=2, stop={2})
    assert answer.tokens == [5] and answer.top_idx.tolist() == [[5, 6]] and answer.dropped == 4


def test_a_vllm_output_becomes_an_answer_through_its_first_stop_token():
    """vLLM lists the top logprobs and, where it is not among them, the sampled token's: it ranks
    last and is cut to --top-k."""
    served = Served(0, [5, 2, 8], 0.0, 0.0, 0.0, None)
    served.logprobs = [[-0.5, -1.5, -6.0], [-0.1, -3.0], [-0.2, -2.0]]
    served.top_ids = [[9, 7, 5], [2, 5], [8, 1]]  # 5 was sampled at the first position, below the top 2
    answer = served_answer(served, top_k=2, stop={2})
    assert answer.tokens == [5, 2] and answer.top_idx.tolist() == [[9, 7], [2, 5]]
    assert answer.top_idx.dtype == torch.int32 and answer.top_logp.dtype == torch.float16
    torch.testing.assert_close(answer.top_logp.float(), torch.tensor([[-0.5, -1.5], [-0.1, -3.0]]), atol=1e-3, rtol=0)
    with pytest.raises(SpecbenchError, match="lower --top-k"):
        served_answer(served, top_k=3, stop={2})
    served.logprobs = served.top_ids = None  # an engine that gave none
    with pytest.raises(SpecbenchError, match="lower --top-k"):
        served_answer(served, top_k=2, stop={2})


def test_agreement_counts_the_positions_whose_likeliest_token_is_the_same():
    logp = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0]]), -1)
    said = torch.tensor([[0, 1], [2, 1], [2, 0]])  # the second position's likeliest differs
    agree, gap = agreement(logp, said, logp.gather(-1, said.long()).half())
    assert agree == 2 and gap == pytest.approx(0.0, abs=1e-2)
    agree, gap = agreement(logp, said, logp.gather(-1, said.long()) - 1.0)  # each off by 1 nat
    assert agree == 2 and gap == pytest.approx(3.0, abs=1e-2)


def test_answers_of_other_weights_are_refused_and_the_targets_own_pass(untied_target, tiny_pair, tmp_path):
    """The check on another engine's first shard: the target's own answers agree everywhere; a draft's
    answers (what a GGUF of other weights gives) are refused, and what was found is written down."""
    # An untied target writes varied text; a tied random model (as the draft) repeats its last token.
    target, draft = load(untied_target, CPU, F32), load(tiny_pair[1], CPU, F32)
    prompts = [[1, 5, 9, 14], [1, 22, 7], [1, 30, 31, 32, 33]]
    record = tmp_path / "generated"
    record.mkdir()
    own = torch_answers(target, 12, 8)(prompts, False, 0)
    assert weights_check(target, prompts, own)["top1_agreement"] == 1.0
    same_weights("llama-cpp", untied_target, target, prompts, own, record)
    found = json.loads((tmp_path / "generated" / "teacher.json").read_text())
    assert found["top1_agreement"] == 1.0 and found["mean_abs_logp_difference"] < 1e-2
    assert found["positions"] == sum(len(a.tokens) for a in own)
    other = torch_answers(draft, 12, 8)(prompts, False, 0)
    with pytest.raises(SpecbenchError, match="do not come from") as refused:
        same_weights("llama-cpp", untied_target, target, prompts, other, record)
    assert "\n" not in str(refused.value)
    found = json.loads((tmp_path / "generated" / "teacher.json").read_text())
    assert found["top1_agreement"] < MIN_AGREEMENT and found["mean_abs_logp_difference"] > MAX_LOGP_DIFFERENCE


def test_a_teacher_engine_that_does_not_exist_is_one_line(tmp_path):
    result = cli("distill", "--out", str(tmp_path / "d"), "--teacher-engine", "vllm-magic")
    one_line_error(result, "--teacher-engine vllm-magic", "use torch or llama-cpp or vllm")
    result = cli(
        "distill", "--out", str(tmp_path / "d"), "--teacher-engine", "llama-cpp", "--teacher-gguf", str(tmp_path / "x")
    )
    one_line_error(result, "--teacher-gguf", "no such file")


def test_a_vllm_teacher_without_vllm_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_engine, "available", lambda: False)
    with pytest.raises(SpecbenchError, match="make install-vllm") as refused:
        DistillConfig(out=tmp_path / "d", teacher_engine="vllm").validate()
    assert "\n" not in str(refused.value)
    DistillConfig(out=tmp_path / "d", teacher_engine="torch").validate()  # torch needs nothing more


DISTILL = ["distill", "--teacher-engine", "llama-cpp", "--teacher-tokens", "0", "--data", "humaneval"]
DISTILL += ["--generate-prompts", "8", "--generate-batch", "4", "--generate-new-tokens", "24", "--top-k", "8"]
DISTILL += ["--epochs", "1", "--batch", "4", "--seq-len", "64", "--sampled-fraction", "0.5"]


@pytest.mark.llama_cpp
def test_llama_cpp_answers_for_the_default_target_and_refuses_a_gguf_of_other_weights(
    llama_cache, tmp_path, monkeypatch
):
    # The session's cache: the target's f32 GGUF and the draft's are those the engine tests made.
    monkeypatch.setenv("SPECBENCH_CACHE", str(llama_cache))
    out = tmp_path / "draft"
    result = cli(*DISTILL, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads((out / "generated" / "teacher.json").read_text())
    assert found["engine"] == "llama-cpp" and found["top1_agreement"] >= MIN_AGREEMENT, found
    assert found["mean_abs_logp_difference"] <= MAX_LOGP_DIFFERENCE, found
    docs = [doc for path in sorted((out / "generated").glob("*.pt")) for doc in torch.load(path)]
    assert len(docs) == 8
    for b, path in enumerate(sorted((out / "generated").glob("*.pt"))):
        for doc in torch.load(path):
            answer = doc["ids"][doc["prompt_len"] :]
            assert 0 < len(answer) <= 24 and doc["top_idx"].shape == (len(answer), 8)
            assert (doc["top_logp"][:, :-1] >= doc["top_logp"][:, 1:]).all()  # likeliest first
            if b % 2 == 0:  # greedy shards (sampled-fraction 0.5: the second of each two is sampled)
                assert torch.equal(answer, doc["top_idx"][:, 0].to(answer.dtype))
    assert (out / "config.json").is_file()  # the draft trained on them

    # The shipped draft's GGUF as the teacher: other weights, refused before a shard is written.
    draft = Path(resolve("smollm2-135m-draft").location)
    draft_gguf = llamacpp.gguf_of(draft, "f32", llamacpp.find_server(), llama_cache / "gguf")
    wrong = tmp_path / "wrong"
    result = cli(*DISTILL, "--out", str(wrong), "--teacher-gguf", str(draft_gguf))
    # The one error line comes after the progress lines that said which GGUF was served.
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "do not come from" in last and "--teacher-gguf" in last, result.stderr
    assert not list((wrong / "generated").glob("*.pt"))
