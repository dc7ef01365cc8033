"""Host reads in the decode loops, counted on CPU: each is a synchronisation on CUDA, where the GPU
idles while the host waits and then queues the next forward. A chain round reads the device once
(its verdict and the tokens it emitted, in one transfer); the baseline reads its tokens once every
STOP_CHECK of them, and its time still ends at its stop token. Also: the sampler they use, an
exponential race with no host read, draws from the law it is given."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specbench.decoding.decode import STOP_CHECK, autoregressive_decode, speculative_decode
from specbench.decoding.kv import EVICT_SLACK
from specbench.decoding.sampling import Sampling, sample
from specbench.decoding.timing import PhaseClock, TimedLM
from specbench.decoding.transfer import ids_to_device
from specbench.drafters.eagle import EagleDrafter
from specbench.drafters.lookup import PromptLookupDrafter
from specbench.drafters.model import ModelDrafter
from specbench.drafters.trees import TreeDrafter
from specbench.models.eagle_head import read_head
from specbench.models.lm import HFCausalLM, WindowLM
from specbench.models.load import load
from specbench.models.static import StaticLM

from ..helpers import HostReads, LawLM, build_eagle3_head, tiny_law_model

CPU = torch.device("cpu")


def test_the_reads_are_counted():
    x = torch.tensor([1, 2])
    with HostReads() as reads:
        int(x[0]), x.tolist(), torch.multinomial(x.float(), 1), x + 1
    assert reads.count == 3
    # Told the decode's device, it leaves out reads of CPU tensors: they wait on no GPU.
    with HostReads("cuda") as reads:
        int(x[0]), x.tolist(), torch.tensor(1e-6).item()
    assert reads.count == 0
    # So is a tensor made from host data on the device, which waits on CUDA; one made on the host
    # and handed over by to_device is not.
    with HostReads() as reads:
        torch.tensor([1, 2], device=CPU), ids_to_device([1, 2], CPU), torch.tensor([1, 2])
    assert reads.count == 1
    # And so is indexing with a list, which torch makes such a tensor; a slice, a tensor index or an
    # empty list copies nothing from the host.
    with HostReads() as reads:
        x[[1]], x[:1], x[ids_to_device([1], CPU)], x[[]]
        x[[0]] = 3
    assert reads.count == 2


LAW = np.array([0.5, 0.0, 0.2, 0.25, 0.05])


def race_counts(race, draws: int = 40_000) -> np.ndarray:
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor(LAW * 3.0, dtype=torch.float32).expand(draws, -1)  # weights need not sum to 1
    return np.bincount(race(probs, generator).view(-1).numpy(), minlength=len(LAW))


def test_the_exponential_race_draws_from_the_law_it_is_given():
    counts = race_counts(sample)
    assert counts[1] == 0  # a zero weight never wins
    keep = LAW > 0
    assert chisquare(counts[keep], LAW[keep] * counts.sum()).pvalue > 1e-3
    with HostReads() as reads:
        sample(torch.tensor([0.2, 0.8]), torch.Generator())
    assert reads.count == 0


def test_the_test_catches_a_race_that_adds_the_noise():
    def added(probs, generator):  # argmax of p + E: not the law of p
        return (probs + torch.empty_like(probs).exponential_(generator=generator)).argmax(-1, keepdim=True)

    counts = race_counts(added)
    assert counts[1] > 0 and chisquare(counts, (LAW + 1e-9) / (LAW + 1e-9).sum() * counts.sum()).pvalue < 1e-6


@pytest.fixture(scope="module")
def models(tiny_pair):
    return HFCausalLM(*_lm(tiny_pair[0])), HFCausalLM(*_lm(tiny_pair[1]))


@pytest.fixture(scope="module")
def cuda_models(tiny_pair):
    """The tiny pair on CUDA's --no-graphs --compile route: specbench's forward, its elementwise work compiled."""
    cuda = torch.device("cuda")
    loaded = [load(path, cuda, torch.float32) for path in tiny_pair]
    return tuple(HFCausalLM.loaded(m.model, m.width, None, compile=True, name=m.name) for m in loaded)


@pytest.fixture(scope="module")
def static_models(tiny_pair):
    """The tiny pair on the static path (models/static.py), uncompiled: its host reads are the loop's."""
    return tuple(static_lm(load(path, CPU, torch.float32), compiled=False) for path in tiny_pair)


@pytest.fixture(scope="module")
def cuda_static_models(tiny_pair):
    """The tiny pair on CUDA's default route: the static path, its forwards replayed as CUDA graphs."""
    return tuple(static_lm(load(path, torch.device("cuda"), torch.float32), compiled=True) for path in tiny_pair)


def static_lm(loaded, compiled: bool) -> StaticLM:
    lm = StaticLM.of(loaded.model, loaded.width, compiled=compiled)
    lm.reserve(128)
    return lm


def _lm(path):
    loaded = load(path, CPU, torch.float32)
    return loaded.model, loaded.width


PROMPT = torch.tensor([5, 9, 14, 5, 9, 14, 5, 9, 3, 7, 5, 9])  # repeats, so prompt lookup finds matches
ON = [
    pytest.param("models", id="cpu"),
    pytest.param("static_models", id="cpu-static"),
    pytest.param("cuda_models", id="cuda", marks=pytest.mark.gpu),
    pytest.param("cuda_static_models", id="cuda-graphs", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafting", ["draft model", "prompt lookup"])
@pytest.mark.parametrize("pair", ON)
def test_a_chain_round_reads_the_device_once(request, pair, temperature, drafting):
    target, draft = request.getfixturevalue(pair)
    device = target.device
    cfg, generator = Sampling(temperature=temperature), torch.Generator(device=device).manual_seed(0)
    drafter = ModelDrafter(draft, cfg, generator) if drafting == "draft model" else PromptLookupDrafter()
    with HostReads(device) as reads:
        result = speculative_decode(target, drafter, PROMPT.to(device), 3, 40, cfg, generator)
    rounds = len(result.accept_counts)
    assert rounds >= 8
    # Once per decode: the first token, the acceptance's sum at the end, and prompt lookup's copy of
    # the prompt and that token.
    assert reads.count <= rounds + 4, f"{reads.count} reads in {rounds} rounds"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pair", ON)
def test_under_a_repetition_penalty_a_round_still_reads_the_device_once(request, pair, temperature):
    # The penalty's context masks (the prompt's, then each drafted prefix's) are made on the device.
    target, draft = request.getfixturevalue(pair)
    device = target.device
    cfg = Sampling(temperature=temperature, repetition_penalty=1.3)
    generator = torch.Generator(device=device).manual_seed(0)
    with HostReads(device) as reads:
        result = speculative_decode(
            target, ModelDrafter(draft, cfg, generator), PROMPT.to(device), 3, 40, cfg, generator
        )
    rounds = len(result.accept_counts)
    assert rounds >= 8 and reads.count <= rounds + 2, f"{reads.count} reads in {rounds} rounds"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pair", [p for p in ON if "static" not in p.id])
def test_a_window_draft_reads_the_device_once_a_round_though_its_window_moves(request, pair, temperature):
    # speculative-window's and triforce's bottom level: the tokens in its window stay on the device.
    target, draft = request.getfixturevalue(pair)
    device, window = target.device, WindowLM(draft.model, draft.width, budget=8)
    cfg, generator = Sampling(temperature=temperature), torch.Generator(device=device).manual_seed(0)
    with HostReads(device) as reads:
        result = speculative_decode(
            target, ModelDrafter(window, cfg, generator), PROMPT.to(device), 3, 40, cfg, generator
        )
    rounds = len(result.accept_counts)
    assert window.window.read > 8 + EVICT_SLACK  # it cut its window at least once
    assert rounds >= 8 and reads.count <= rounds + 2, f"{reads.count} reads in {rounds} rounds"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "drafting,reads_a_round",
    [({}, 1), ({"shape": (2, 2)}, 1), ({"dynamic": (5, 2)}, 2)],
    ids=["chain", "tree", "dynamic tree"],
)
def test_an_eagle_round_reads_the_device_once_and_a_dynamic_tree_once_more(
    tmp_path, temperature, drafting, reads_a_round
):
    # A dynamic tree's shape is chosen on the device from the head's scores: the host reads it once,
    # to build the verification's mask, and then the verdict.
    target = LawLM(tiny_law_model(1, tmp_path), packed=True)
    config = target.model.config
    path = build_eagle3_head(tmp_path / "head", config, taps=(0, 1, 2), draft_ids=[0, 2], seed=3)
    embed = target.model.get_input_embeddings().weight
    head = read_head(path, embed, config.num_hidden_layers, config.hidden_size, config.vocab_size)
    target.record_features(head.config.taps)
    cfg, generator = Sampling(temperature=temperature), torch.Generator().manual_seed(0)
    drafter = EagleDrafter(head, target, 3, cfg, generator, **drafting)
    with HostReads() as reads:
        result = speculative_decode(target, drafter, torch.tensor([0, 2, 1]), 3, 30, cfg, generator)
    rounds = len(result.accept_counts)
    assert rounds >= 5 and reads.count <= reads_a_round * rounds + 2, f"{reads.count} reads in {rounds} rounds"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_round_reads_the_device_once(models, temperature):
    target, draft = models
    cfg, generator = Sampling(temperature=temperature), torch.Generator().manual_seed(0)
    with HostReads() as reads:
        result = speculative_decode(target, TreeDrafter(draft, cfg, generator, (2, 2)), PROMPT, 2, 40, cfg, generator)
    rounds = len(result.accept_counts)
    assert rounds >= 8 and reads.count <= rounds + 2, f"{reads.count} reads in {rounds} rounds"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pair", ON)
def test_the_baseline_reads_its_tokens_once_every_stop_check(request, pair, temperature):
    target, _ = request.getfixturevalue(pair)
    cfg, device = Sampling(temperature=temperature), target.device
    with HostReads(device) as reads:
        result = autoregressive_decode(target, PROMPT.to(device), 40, cfg, torch.Generator(device).manual_seed(0))
    assert len(result.tokens) == 40 and result.target_forwards == 40 and result.past_stop == 0
    assert reads.count <= math.ceil(40 / STOP_CHECK) + 1


def test_the_baseline_stops_at_its_stop_token_and_its_time_ends_there(untied_target):
    """A stop token found late (at the next read) ends the decode where it was chosen: the tokens, the
    forwards and the clock's laps are those of a decode that read every token."""
    target = HFCausalLM(*_lm(untied_target))  # it writes varied text: a token can stop it mid-chunk
    cfg = Sampling()
    free = autoregressive_decode(target, PROMPT, 24, cfg, torch.Generator()).tokens
    # The first token not seen before, after the first: forwards run past it before the first read.
    at = next(i for i in range(1, STOP_CHECK - 1) if free[i] not in free[:i])
    clock = PhaseClock(CPU)
    timed = TimedLM(target, clock, "verify")
    clock.start()
    result = autoregressive_decode(timed, PROMPT, 24, cfg, torch.Generator(), frozenset({free[at]}))
    assert result.tokens == free[: at + 1] and result.target_forwards == at + 1
    assert result.past_stop == STOP_CHECK - (at + 1) > 0
    phases = clock.stop(result.past_stop)
    kept = [phase for phase, _ in clock.marks[1:]]
    assert kept == ["other", "prefill"] + ["other", "verify"] * at + ["other"]  # the kept forwards alone
    assert phases.total == pytest.approx(clock.marks[-1][1] - clock.marks[0][1])
