"""lookup-or-draft: prompt lookup's rounds and the draft model's rounds in one decode must keep the
target's exact law, and greedy decoding must equal the target's own."""

from collections import Counter

import pytest
import torch

from specbench.decoding.decode import Draft, autoregressive_decode, speculative_decode
from specbench.decoding.sampling import Sampling
from specbench.drafters.chained import FirstThatDrafts
from specbench.drafters.lookup import PromptLookupDrafter
from specbench.drafters.model import ModelDrafter

from ..toy import P_FLOOR, VOCAB, ToyLM, chi_square_p

pytestmark = pytest.mark.usefixtures("one_thread")


class CountedRounds(FirstThatDrafts):
    """lookup-or-draft's drafters in turn (prompt lookup, then the model), counting which drafted each
    round, so a test can show it exercised both."""

    def __init__(self, model: ModelDrafter, lookup_k: int, shortest: int = 2):
        super().__init__([PromptLookupDrafter(shortest=shortest, lookahead=lookup_k), model])
        self.model, self.rounds = model, Counter()

    def propose(self, k: int) -> Draft:
        draft = super().propose(k)
        self.rounds["model" if self.drafted_by is self.model else "lookup"] += 1
        return draft


class LookupTokensWithModelRows(CountedRounds):
    """Broken on purpose: in lookup's rounds the model drafts as well, and lookup's tokens go up with
    the model's rows, which they were not drawn from (a merge that lets the copy win but keeps q)."""

    def propose(self, k: int) -> Draft:
        draft = super().propose(k)
        if self.drafted_by is self.model:
            return draft
        self.drafted_by = self.model  # the model's state follows its own round
        model = self.model.propose(len(draft.tokens))
        return Draft.chain(draft.tokens, model.q, forwards=model.forwards)


def hybrid(cfg: Sampling, kind=CountedRounds, lookup_k: int = 3, shortest: int = 2) -> CountedRounds:
    model = ModelDrafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(7))
    return kind(model, lookup_k, shortest)


@pytest.mark.parametrize(
    "cfg,shortest",
    [
        (Sampling(temperature=1.0), 2),
        pytest.param(Sampling(temperature=1.0), 1, marks=pytest.mark.slow),
        pytest.param(Sampling(temperature=0.7, top_k=2), 2, marks=pytest.mark.slow),
    ],
)
def test_lookup_or_draft_matches_target_law(cfg, shortest):
    drafter = hybrid(cfg, shortest=shortest)
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, 2, cfg) > P_FLOOR
    assert drafter.rounds["lookup"] > 1000 and drafter.rounds["model"] > 1000  # both kinds of round ran


def test_the_test_catches_lookup_tokens_passed_up_with_the_models_rows():
    cfg = Sampling(temperature=1.0)
    broken = hybrid(cfg, LookupTokensWithModelRows)
    assert chi_square_p(ToyLM(VOCAB, seed=1), broken, 2, cfg) < P_FLOOR
    assert broken.rounds["lookup"] > 1000


@pytest.mark.parametrize("k,lookup_k", [(1, 4), (2, 6), (4, 2)])
@pytest.mark.parametrize("adjusted", [Sampling(0.0), Sampling(0.0, repetition_penalty=1.6, logit_bias=((2, 0.5),))])
def test_greedy_lookup_or_draft_equals_greedy_baseline_on_toy(k, lookup_k, adjusted):
    target, prompt = ToyLM(5, seed=3), torch.tensor([1, 4, 0, 2, 1, 4])
    noisy = ToyLM(5, seed=3)  # the target plus noise: agrees often, not always
    noisy.table = noisy.table + 1.5 * torch.randn(noisy.table.shape, generator=torch.Generator().manual_seed(9))
    drafter = CountedRounds(ModelDrafter(noisy, adjusted, torch.Generator()), lookup_k)
    g = torch.Generator()
    want = autoregressive_decode(target, prompt, 40, adjusted, g).tokens
    got = speculative_decode(target, drafter, prompt, k, 40, adjusted, g)
    assert got.tokens == want
    assert drafter.rounds["lookup"] > 0 and drafter.rounds["model"] > 0
    # beneath.kept counts lookup's tokens in the output; the model's forwards come from its rounds only.
    assert 0 < got.beneath.kept <= got.accepted and got.beneath.drafted > 0
    assert got.draft_forwards == k * drafter.rounds["model"]
    assert max(got.draft_counts) <= max(k, lookup_k)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_model_reads_lookups_rounds_so_the_target_as_its_own_draft_is_always_accepted(k):
    # Greedy, with the target as the draft model: a model round is accepted in full only if the
    # model's cache holds every token the target kept, lookup's rounds' included.
    cfg, g = Sampling(0.0), torch.Generator().manual_seed(0)
    for seed in range(3):
        target, prompt = ToyLM(12, seed=seed, scale=0.5), torch.randint(0, 12, (40,), generator=g)
        drafter = CountedRounds(ModelDrafter(ToyLM(12, seed=seed, scale=0.5), cfg, torch.Generator()), 4)
        result = speculative_decode(target, drafter, prompt, k, 80, cfg, torch.Generator())
        assert drafter.rounds["lookup"] > 5 and drafter.rounds["model"] > 1
        assert result.accepted - result.beneath.kept == result.drafted - result.beneath.drafted  # every model token
