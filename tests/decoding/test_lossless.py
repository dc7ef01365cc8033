"""Speculative sampling must reproduce the target's exact sequence distribution."""

from collections import Counter

import pytest
import torch

from specbench.decoding import decode, sampling
from specbench.decoding.decode import Draft, autoregressive_decode, speculative_decode
from specbench.decoding.sampling import Sampling, warp
from specbench.drafters.cascade import CascadeDrafter
from specbench.drafters.lookup import PromptLookupDrafter
from specbench.drafters.model import ModelDrafter
from specbench.drafters.propose import tree_parents
from specbench.drafters.trees import LookupTreeDrafter, TreeDrafter
from specbench.methods.online import rejection

from ..toy import LENGTH, P_FLOOR, PROMPT, SAMPLES, VOCAB, ToyLM, chi_square_p, law_p

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "cfg,k",
    [
        (Sampling(temperature=1.0), 1),  # the fast suite's check of the sampled chain verifier
        pytest.param(Sampling(temperature=1.0), 3, marks=pytest.mark.slow),
        pytest.param(Sampling(temperature=0.7, top_k=2), 2, marks=pytest.mark.slow),
        pytest.param(Sampling(temperature=1.3, top_p=0.8), 2, marks=pytest.mark.slow),
    ],
)
def test_speculative_sampling_matches_target_law(cfg, k):
    assert chi_square_p(ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2), k, cfg) > P_FLOOR


@pytest.mark.slow
def test_prompt_lookup_drafting_matches_target_law():
    # One-hot drafts proposed from n-gram matches; with 3 tokens, matches are frequent.
    lookup = PromptLookupDrafter(max_ngram=2)
    assert chi_square_p(ToyLM(VOCAB, seed=1), lookup, 3, Sampling(temperature=1.0)) > P_FLOOR


class ShortlistedToy(ToyLM):
    """A draft that can never propose one token, as a draft with a vocabulary shortlist cannot."""

    def forward(self, token_ids: torch.Tensor, last: int = 1) -> torch.Tensor:
        logits = super().forward(token_ids, last).clone()
        logits[:, 1] = float("-inf")
        return logits


@pytest.mark.slow
def test_a_draft_blind_to_a_token_still_gives_the_target_law():
    # q is zero on token 1, which the target often picks: only the residual can produce it.
    assert chi_square_p(ToyLM(VOCAB, seed=1), ShortlistedToy(VOCAB, seed=2), 2, Sampling(temperature=1.0)) > P_FLOOR


def _verify_with_residual_p(draft_tokens, q, p, generator):
    """A common bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    monkey = sampling.residual
    try:
        sampling.residual = lambda p_row, q_row: p_row
        return sampling.verify_chain_sampled(draft_tokens, q, p, generator)
    finally:
        sampling.residual = monkey


def _verify_with_stale_bonus(draft_tokens, q, p, generator):
    """Another bug: the bonus token drawn from p_K (an off-by-one) instead of p_{K+1}."""
    return sampling.verify_chain_sampled(draft_tokens, q, torch.cat([p[:-1], p[-2:-1]]), generator)


@pytest.mark.parametrize("broken", [_verify_with_residual_p, _verify_with_stale_bonus])
@pytest.mark.slow
def test_the_test_catches_a_broken_verifier(monkeypatch, broken):
    monkeypatch.setattr(decode, "verify_chain_sampled", broken)
    assert (
        chi_square_p(ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2), 1, Sampling(temperature=1.0), negative_control=True)
        < P_FLOOR
    )


def test_identical_draft_accepts_everything_and_earns_the_bonus():
    target = ToyLM(VOCAB, seed=1)
    cfg, g = Sampling(1.0), torch.Generator().manual_seed(0)
    result = speculative_decode(target, ModelDrafter(ToyLM(VOCAB, seed=1), cfg, g), torch.tensor(PROMPT), 3, 21, cfg, g)
    assert result.accept_counts == [3] * 5  # 1 token from prefill, then 5 rounds of K + 1 = 4
    assert len(result.tokens) == 21
    assert result.beta_sum == pytest.approx(result.tested)


@pytest.mark.parametrize(
    "cfg",
    [
        Sampling(temperature=1.0, repetition_penalty=2.0),  # the fast suite's: rows see their drafts
        pytest.param(Sampling(temperature=0.8, min_p=0.3), marks=pytest.mark.slow),
        pytest.param(Sampling(temperature=1.0, logit_bias=((1, 1.5), (2, -1.0))), marks=pytest.mark.slow),
    ],
)
def test_repetition_penalty_min_p_and_logit_bias_keep_the_target_law(cfg):
    """Both the baseline and speculative decoding sample the adjusted law: the draft's rows and the
    target's are adjusted at the same contexts (each row's context includes the drafts before it)."""
    target, g = ToyLM(VOCAB, seed=1), torch.Generator().manual_seed(4)
    alone = Counter(
        tuple(autoregressive_decode(target, torch.tensor(PROMPT), LENGTH, cfg, g).tokens) for _ in range(SAMPLES)
    )
    assert law_p(target, cfg, alone) > P_FLOOR
    assert chi_square_p(target, ToyLM(VOCAB, seed=2), 3, cfg) > P_FLOOR


def test_the_test_catches_a_penalty_blind_to_the_rounds_drafts(monkeypatch):
    """A verifier whose rows are penalised for the context before the round only, not for the drafts
    before them in the round: the law moves."""
    cfg = Sampling(temperature=1.0, repetition_penalty=3.0)
    assert chi_square_p(ToyLM(VOCAB, seed=5), ToyLM(VOCAB, seed=1), 3, cfg) > P_FLOOR
    monkeypatch.setattr(decode, "_seen_rows", lambda seen, tokens: seen.expand(len(tokens) + 1, -1))
    assert chi_square_p(ToyLM(VOCAB, seed=5), ToyLM(VOCAB, seed=1), 3, cfg, negative_control=True) < P_FLOOR


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("drafter", ["model", "prompt-lookup"])
@pytest.mark.parametrize("adjusted", [Sampling(0.0), Sampling(0.0, repetition_penalty=1.6, logit_bias=((2, 0.5),))])
def test_greedy_speculative_equals_greedy_baseline_on_toy(k, drafter, adjusted):
    target, prompt = ToyLM(5, seed=3), torch.tensor([1, 4])
    if drafter == "model":  # the target plus noise: agrees often, not always
        draft = ToyLM(5, seed=3)
        draft.table = draft.table + 1.5 * torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(9))
        draft = ModelDrafter(draft, adjusted, torch.Generator())
    else:
        draft = PromptLookupDrafter()
    greedy, g = adjusted, torch.Generator()
    want = autoregressive_decode(target, prompt, 30, greedy, g).tokens
    got = speculative_decode(target, draft, prompt, k, 30, greedy, g)
    assert got.tokens == want
    assert 0 < got.accepted <= got.drafted


def test_stop_token_ends_both_decoders_at_the_same_place():
    target, draft, prompt = ToyLM(5, seed=3), ToyLM(5, seed=4), torch.tensor([1, 4])
    greedy, g = Sampling(0.0), torch.Generator()
    full = autoregressive_decode(target, prompt, 30, greedy, g).tokens
    stop = frozenset({full[7]})
    cut = full[: full.index(full[7]) + 1]
    assert autoregressive_decode(target, prompt, 30, greedy, g, stop).tokens == cut
    assert speculative_decode(target, ModelDrafter(draft, greedy, g), prompt, 4, 30, greedy, g, stop).tokens == cut


# ---------------------------------------------------------------- trees

SAMPLED_TREES = [
    (Sampling(temperature=1.0), (2, 2)),  # the fast suite's check of the sampled tree verifier
    pytest.param(Sampling(temperature=1.0), (3, 1, 1), marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=0.8, top_k=2), (2, 2), marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=1.2, top_p=0.85), (3, 1, 1), marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=1.0, eta=0.2), (2, 2), marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=1.3, top_k=2, eta=0.1), (3, 1, 1), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("cfg,shape", SAMPLED_TREES)
def test_tree_of_children_drawn_from_q_gives_the_target_law(cfg, shape):
    drafter = TreeDrafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(5), shape)
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, len(shape), cfg) > P_FLOOR


@pytest.mark.parametrize(
    "cfg,shape",
    [
        (Sampling(temperature=1.0), (2, 2)),
        (Sampling(temperature=1.0), (3, 1, 1)),
        (Sampling(temperature=1.2, top_p=0.85), (2, 2)),
        (Sampling(temperature=1.0, eta=0.2), (3, 1, 1)),
    ],
)
@pytest.mark.slow
def test_tree_of_deterministic_candidates_gives_the_target_law(cfg, shape):
    drafter = LookupTreeDrafter(nodes=len(tree_parents(shape)), depth=len(shape), max_ngram=2)
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, len(shape), cfg) > P_FLOOR


@pytest.mark.slow
def test_the_test_catches_a_tree_verifier_that_keeps_p_after_a_rejection(monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p_row, q_row: p_row)
    cfg = Sampling(temperature=1.0)
    drafter = TreeDrafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(5), (2, 2))
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, 2, cfg, negative_control=True) < P_FLOOR


@pytest.mark.slow
def test_the_test_catches_a_tree_verifier_that_does_not_renormalise(monkeypatch):
    monkeypatch.setattr(sampling, "normalised", lambda weights: weights)
    drafter = LookupTreeDrafter(nodes=6, depth=2, max_ngram=2)
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, 2, Sampling(temperature=1.0), negative_control=True) < P_FLOOR


@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["drawn from q", "deterministic"])
def test_the_test_catches_a_tree_verifier_whose_candidates_share_a_uniform(monkeypatch, drafting):
    # The verifier draws every uniform before its walk: each candidate it tries must have its own.
    monkeypatch.setattr(sampling, "uniforms", lambda n, generator, device: torch.rand(1, generator=generator).expand(n))
    cfg = Sampling(temperature=1.0)
    if drafting == "deterministic":
        drafter = LookupTreeDrafter(nodes=6, depth=2, max_ngram=2)
    else:
        drafter = TreeDrafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(5), (2, 2))
    assert chi_square_p(ToyLM(VOCAB, seed=1), drafter, 2, cfg, negative_control=True) < P_FLOOR


@pytest.mark.parametrize("shape", [(2, 2), (3, 1, 1), (2, 2, 1), (4,)])
def test_greedy_tree_decoding_equals_the_greedy_baseline_on_toy(shape):
    target, prompt, greedy = ToyLM(5, seed=3), torch.tensor([1, 4]), Sampling(0.0)
    draft = ToyLM(5, seed=3)
    draft.table = draft.table + 1.5 * torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(9))
    want = autoregressive_decode(target, prompt, 30, greedy, torch.Generator()).tokens
    for drafter in (
        TreeDrafter(draft, greedy, torch.Generator(), shape),
        LookupTreeDrafter(len(tree_parents(shape)), len(shape)),
    ):
        got = speculative_decode(target, drafter, prompt, len(shape), 30, greedy, torch.Generator())
        assert got.tokens == want and 0 < got.accepted <= got.drafted


def test_eta_truncation_is_transformers_eta_warper():
    from transformers.generation.logits_process import EtaLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for eta in (0.01, 0.1, 0.3):
        ours = sampling.warp(logits, Sampling(temperature=1.0, eta=eta)) > 0
        theirs = torch.isfinite(EtaLogitsWarper(eta)(None, logits.clone()))
        assert torch.equal(ours, theirs) and (~ours).any()  # it truncates, exactly where transformers does


CASCADE_CONFIGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=2),
    Sampling(temperature=1.3, top_p=0.8),
]


def cascade(cfg: Sampling, split: int | None = None, draft: ToyLM | None = None) -> CascadeDrafter:
    return CascadeDrafter(draft or ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(7), split, ngram=2)


# Each split with one sampling configuration, each configuration once: the warp is applied as in every
# other law test, and what a cascade adds is where the rows of each position come from (the split).
# The vertical cascade, where the draft model checks lookup's proposals itself, runs under top-k, which
# truncates what it checks.
@pytest.mark.parametrize(("cfg", "split"), list(zip(CASCADE_CONFIGS, [1, None, 2], strict=True)))
@pytest.mark.slow
def test_cascade_matches_target_law(cfg, split):
    # Vertical (split None): lookup proposes beneath the draft model; with a split the model drafts
    # the first positions and lookup the rest.
    assert chi_square_p(ToyLM(VOCAB, seed=1), cascade(cfg, split), 3, cfg) > P_FLOOR


class CascadeWithStaleQ(CascadeDrafter):
    """Broken: each token judged against the model's row one position earlier (an off-by-one in the
    rows passed up). Dropping the rows altogether (q None) would not be a control: a candidate drawn
    independently of the verifier and judged as deterministic still gives the target's law."""

    def propose(self, k):
        draft = super().propose(k)
        return decode.Draft.chain(draft.tokens, torch.cat([draft.q[:1], draft.q[:-1]]), draft.forwards)


def _unchecked_round(target, drafter, last, k, cfg, generator):
    """Broken: lookup's proposal taken whole, without the model's accept test, then one model sample."""
    draft = drafter.propose(k)
    n = len(draft.tokens)
    logits = target.forward(torch.cat([last, draft.tokens]), last=n + 1)
    p = sampling.warp(logits, cfg)
    verdict = sampling.Verdict(list(range(n)), sampling.sample(p[-1], generator), 0.0, 0)
    drafter.accepted(draft, verdict)
    return decode.Round(draft, verdict, logits, p)


@pytest.mark.slow
def test_the_test_catches_a_cascade_that_passes_up_the_wrong_rows():
    cfg = Sampling(temperature=1.0)
    broken = CascadeWithStaleQ(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(7), None, 2)
    assert chi_square_p(ToyLM(VOCAB, seed=1), broken, 3, cfg, negative_control=True) < P_FLOOR


@pytest.mark.slow
def test_the_test_catches_a_cascade_whose_inner_check_is_not_exact(monkeypatch):
    cfg = Sampling(temperature=1.0)
    draft = ToyLM(VOCAB, seed=2)
    exact = decode.speculative_round

    def rounds(target, *args):  # only the inner level, where the draft model is the verifier, is broken
        return (_unchecked_round if target is draft else exact)(target, *args)

    monkeypatch.setattr("specbench.drafters.cascade.speculative_round", rounds)  # the cascade's own rounds
    assert chi_square_p(ToyLM(VOCAB, seed=1), cascade(cfg, draft=draft), 3, cfg, negative_control=True) < P_FLOOR


def three_levels(cfg: Sampling, inner_k: int) -> CascadeDrafter:
    """TriForce's shape on toys: a middle model checks the proposals of a small model beneath it."""
    lower = ModelDrafter(ToyLM(VOCAB, seed=3), cfg, torch.Generator().manual_seed(8))
    return CascadeDrafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(7), lower=lower, inner_k=inner_k)


@pytest.mark.parametrize("inner_k", [1, 2])
@pytest.mark.parametrize("cfg", CASCADE_CONFIGS[:2])
@pytest.mark.slow
def test_a_model_beneath_a_model_matches_target_law(cfg, inner_k):
    assert chi_square_p(ToyLM(VOCAB, seed=1), three_levels(cfg, inner_k), 3, cfg) > P_FLOOR


class LowerRowsPassedUp(CascadeDrafter):
    """Broken: the bottom level's rows, not the middle level's, are passed up as the q of the
    target's check (the middle level's tokens are distributed by its own rows, not the bottom's)."""

    def propose(self, k):
        draft = super().propose(k)
        read = self.model.seen[: len(self.model.seen) - (k - 1)]  # the middle model read all but its last token
        contexts = [read + draft.tokens[:i].tolist() for i in range(k)]
        rows = [warp(self.lower.model.logits_after(context), self.sampling) for context in contexts]
        return decode.Draft.chain(draft.tokens, torch.stack(rows), draft.forwards)


@pytest.mark.slow
def test_the_test_catches_a_middle_level_whose_rows_are_not_passed_up():
    cfg = Sampling(temperature=1.0)
    broken = LowerRowsPassedUp(
        ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(7), lower=three_levels(cfg, 1).lower
    )
    assert chi_square_p(ToyLM(VOCAB, seed=1), broken, 3, cfg, negative_control=True) < P_FLOOR


def test_a_cascade_counts_what_each_level_contributed():
    # Greedy, with the target as its own draft model: the target accepts every token the draft model
    # ends with, so every lookup token the draft model accepted reaches the output.
    cfg, prompt = Sampling(temperature=0.0), torch.tensor([1, 4, 1, 4, 1])
    target = ToyLM(5, seed=3)
    vertical = speculative_decode(
        target, CascadeDrafter(ToyLM(5, seed=3), cfg, torch.Generator()), prompt, 4, 40, cfg, torch.Generator()
    )
    assert vertical.accepted == vertical.drafted and 0 < vertical.beneath.kept == vertical.beneath.accepted
    assert vertical.beneath.accepted <= vertical.beneath.drafted
    # With a split the tokens after the first one are lookup's alone: offered to the target directly.
    split = speculative_decode(
        target, CascadeDrafter(ToyLM(5, seed=3), cfg, torch.Generator(), split=1), prompt, 4, 40, cfg, torch.Generator()
    )
    assert split.beneath.drafted == 0 and split.draft_forwards == split.target_forwards - 1  # one model token a round
    assert split.beneath.kept == split.accepted - split.draft_forwards


@pytest.mark.parametrize("split", [None, 1])
def test_greedy_cascade_equals_greedy_target(split):
    cfg = Sampling(temperature=0.0)
    target, prompt = ToyLM(VOCAB, seed=1), torch.tensor(PROMPT)
    generator = torch.Generator().manual_seed(0)
    expected = autoregressive_decode(target, prompt, 12, cfg, generator).tokens
    result = speculative_decode(target, cascade(cfg, split), prompt, 3, 12, cfg, generator)
    assert result.tokens == expected


# ---------------------------------------------------------------- online draft updates


class ToyLearner:
    """Online updates for a toy draft: after each sequence, the draft's row at every context where
    the target rejected it moves toward the target's log-probabilities there (the lessons that
    online.rejection keeps), as the real learner's distillation step moves a draft model."""

    def __init__(self, draft: ToyLM, rate: float = 0.5):
        self.draft, self.rate, self.lessons = draft, rate, []

    def keep(self, round_, at):
        if (lesson := rejection(round_, at)) is not None:
            self.lessons.append(lesson)

    def update(self, tokens: list[int]) -> None:
        sequence = PROMPT + tokens
        for lesson in self.lessons:
            context = sequence[: len(PROMPT) + lesson.position]
            prev2 = context[-2] if len(context) > 1 else self.draft.vocab
            row = self.draft.table[prev2, context[-1]]
            teacher = torch.full_like(row, -30.0).scatter(0, lesson.top_idx, lesson.top_logp)
            row += self.rate * (teacher - row.log_softmax(-1))
        self.lessons = []


def online_counts(target: ToyLM, drafter, learner: ToyLearner, k: int, cfg: Sampling, samples: int = SAMPLES):
    """Sequences sampled one after another, the draft updated between them, and the acceptance rate
    over the last thousand."""
    generator, prompt, counts, rates = torch.Generator().manual_seed(0), torch.tensor(PROMPT), Counter(), []
    for _ in range(samples):
        result = speculative_decode(target, drafter, prompt, k, LENGTH, cfg, generator, on_round=learner.keep)
        learner.update(result.tokens)
        counts[tuple(result.tokens)] += 1
        rates.append(result.accepted / result.drafted)
    return counts, sum(rates[-1000:]) / 1000


@pytest.mark.parametrize(
    "cfg",
    [
        Sampling(1.0),  # the fast suite's check of a draft that changes between sequences
        pytest.param(Sampling(temperature=0.8, top_k=2), marks=pytest.mark.slow),
        pytest.param(Sampling(temperature=1.2, top_p=0.85), marks=pytest.mark.slow),
    ],
)
def test_a_draft_updated_between_sequences_gives_the_target_law(cfg):
    target, draft = ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2)
    frozen = ModelDrafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(5))
    _, before = online_counts(target, frozen, ToyLearner(frozen.model, rate=0.0), 2, cfg, samples=1000)
    drafter = ModelDrafter(draft, cfg, torch.Generator().manual_seed(5))
    counts, after = online_counts(target, drafter, ToyLearner(draft), 2, cfg)
    assert law_p(target, cfg, counts) > P_FLOOR
    assert after > before + 0.1  # it learned: the updates were real, not a no-op that passes trivially


class RowsFromTheUpdatedCopy(ModelDrafter):
    """Broken: a double-buffered online draft samples its tokens with the weights in use but reads
    their q rows from the copy its trainer has already updated, so q is not the distribution the
    tokens came from."""

    def __init__(self, model: ToyLM, cfg, generator, updated: ToyLM):
        super().__init__(model, cfg, generator)
        self.updated = updated

    def propose(self, k):
        draft = super().propose(k)
        read = self.model.seen[: len(self.model.seen) - (k - 1)]  # what it had read before its first token
        rows = [warp(self.updated.logits_after(read + draft.tokens[:i].tolist()), self.sampling) for i in range(k)]
        return Draft.chain(draft.tokens, torch.stack(rows), draft.forwards)


@pytest.mark.slow
def test_the_test_catches_rows_read_from_an_updated_copy_of_the_draft():
    cfg = Sampling(1.0)
    target, draft, updated = ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2), ToyLM(VOCAB, seed=2)
    updated.table = 0.5 * (draft.table + target.table)  # one update's worth closer to the target
    drafter = RowsFromTheUpdatedCopy(draft, cfg, torch.Generator().manual_seed(5), updated)
    assert chi_square_p(target, drafter, 2, cfg, negative_control=True) < P_FLOOR


# ---------------------------------------------------------------- lookahead policies (--k-policy)

# A p_min per setting that about half of the toy draft's rows fall below, so rounds stop anywhere
# from their first position to their last.
CONFIDENCE = [
    (Sampling(temperature=1.0), 0.7),  # the fast suite's check of the confidence stop
    pytest.param(Sampling(temperature=0.7, top_k=2), 0.8, marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=1.3, top_p=0.8), 0.7, marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=1.0, eta=0.2), 0.7, marks=pytest.mark.slow),
]


def unsure_drafter(cfg: Sampling, p_min: float, drafter=ModelDrafter) -> ModelDrafter:
    return drafter(ToyLM(VOCAB, seed=2), cfg, torch.Generator().manual_seed(5), p_min=p_min)


@pytest.mark.parametrize("cfg,p_min", CONFIDENCE)
def test_a_draft_that_stops_where_it_is_unsure_gives_the_target_law(cfg, p_min):
    assert chi_square_p(ToyLM(VOCAB, seed=1), unsure_drafter(cfg, p_min), 3, cfg) > P_FLOOR


def test_the_confidence_stop_drafts_from_none_to_k_and_an_empty_round_is_one_target_step():
    cfg = Sampling(temperature=1.0)
    result = speculative_decode(
        ToyLM(VOCAB, seed=1), unsure_drafter(cfg, 0.7), torch.tensor(PROMPT), 3, 40, cfg, torch.Generator()
    )
    assert {0, 3} <= set(result.draft_counts) <= {0, 1, 2, 3}  # it stopped early, and not always
    assert len(result.draft_counts) == result.target_forwards - 1 and sum(result.draft_counts) == result.drafted
    # A round that drafted nothing emitted one token, the target's own: the output is still whole.
    assert len(result.tokens) == 1 + sum(n + 1 for n in result.accept_counts) >= 40
    assert all(n == 0 for n, drafted in zip(result.accept_counts, result.draft_counts, strict=True) if drafted == 0)


class ArgmaxWhereUnsure(ModelDrafter):
    """Broken: where its row is unsure it drafts the row's most likely token, rather than stopping
    short of it, and passes the row up as that token's q, though the token was not drawn from it."""

    def propose(self, k):
        draft = super().propose(k)
        if len(draft.tokens) == k:
            return draft
        row = warp(self.model.logits_after(self.model.seen), self.sampling)
        self.pending = sampling.argmax(row)  # unread, as a drafter's last token is
        q = row[None] if draft.q is None else torch.cat([draft.q, row[None]])
        return Draft.chain(torch.cat([draft.tokens, self.pending]), q, draft.forwards)


@pytest.mark.slow
def test_the_test_catches_a_confidence_stop_that_drafts_the_unsure_token():
    cfg = Sampling(temperature=1.0)
    broken = unsure_drafter(cfg, 0.7, drafter=ArgmaxWhereUnsure)
    assert chi_square_p(ToyLM(VOCAB, seed=1), broken, 3, cfg, negative_control=True) < P_FLOOR


HEURISTIC = [
    (Sampling(temperature=1.0), 1),  # the fast suite's check of a K set by past verdicts
    pytest.param(Sampling(temperature=1.0), 2, marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=0.7, top_k=2), 1, marks=pytest.mark.slow),
    pytest.param(Sampling(temperature=1.3, top_p=0.8), 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("cfg,k", HEURISTIC)
def test_a_lookahead_set_by_past_verdicts_gives_the_target_law(cfg, k):
    assert chi_square_p(ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2), k, cfg, schedule=decode.heuristic_k) > P_FLOOR


@pytest.mark.slow
def test_a_lookahead_set_by_past_verdicts_over_prompt_lookup_gives_the_target_law():
    # Deterministic candidates, and rounds without a match that draft nothing.
    cfg = Sampling(temperature=1.0)
    lookup = PromptLookupDrafter(max_ngram=2)
    assert chi_square_p(ToyLM(VOCAB, seed=1), lookup, 2, cfg, schedule=decode.heuristic_k) > P_FLOOR


def test_the_heuristic_schedule_is_transformers():
    assert [decode.heuristic_k(4, 4, 4), decode.heuristic_k(4, 4, 3), decode.heuristic_k(1, 1, 0)] == [6, 3, 1]
    assert decode.heuristic_k(3, 0, 0) == 3  # a round without a draft leaves K alone
    cfg, g = Sampling(temperature=1.0), torch.Generator()
    itself = ModelDrafter(ToyLM(VOCAB, seed=1), cfg, g)
    same = speculative_decode(
        ToyLM(VOCAB, seed=1), itself, torch.tensor(PROMPT), 1, 34, cfg, g, schedule=decode.heuristic_k
    )
    # A draft that is the target is always accepted: K grows by 2, capped by the tokens still to generate.
    assert same.draft_counts == [1, 3, 5, 7, 9, 3] and same.accept_counts == same.draft_counts


def _round_cut_at_the_new_k(exact):
    """Broken: a schedule that caps what a round emits at the lookahead it sets for the next round,
    dropping the verdict's last tokens (the correction, after a rejection at the last position)."""

    def cut(target, drafter, last, k, cfg, generator, *rest):
        round_ = exact(target, drafter, last, k, cfg, generator, *rest)
        emitted, n = round_.emitted, round_.verdict.accepted
        keep = min(len(emitted), decode.heuristic_k(k, len(round_.draft.tokens), n))
        if keep == len(emitted):
            return round_
        # The new last token is an accepted draft the target has read: it reads it again next round.
        target.keep(range(keep - 1), n)
        told = drafter.model.length + len(drafter.pending)
        drafter.rewind_to(told - (len(emitted) - keep) - 1, emitted[keep - 1 : keep])
        verdict = sampling.Verdict(round_.verdict.path[: keep - 1], emitted[keep - 1 : keep], 0.0, 0)
        return decode.Round(round_.draft, verdict, round_.logits, round_.p)

    return cut


@pytest.mark.slow
def test_the_test_catches_a_schedule_that_cuts_a_round_at_the_new_k(monkeypatch):
    monkeypatch.setattr(decode, "speculative_round", _round_cut_at_the_new_k(decode.speculative_round))
    cfg = Sampling(temperature=1.0)
    assert (
        chi_square_p(
            ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2), 2, cfg, schedule=decode.heuristic_k, negative_control=True
        )
        < P_FLOOR
    )


# The baseline's samples in batches (the audit's reference arms): each row an independent draw of the law.
@pytest.mark.parametrize(
    "cfg",
    [Sampling(temperature=1.0, repetition_penalty=2.0), Sampling(temperature=0.8, top_k=2, logit_bias=((1, 1.0),))],
)
def test_the_baselines_batched_samples_give_the_target_law(tmp_path, cfg):
    from specbench.decoding.decode import autoregressive_samples

    from ..helpers import LawLM, tiny_law_model

    model = tiny_law_model(1, tmp_path)
    answers = autoregressive_samples(
        model, torch.tensor(PROMPT), SAMPLES, LENGTH, cfg, torch.Generator().manual_seed(0)
    )
    assert len(answers) == SAMPLES and law_p(LawLM(model, packed=False), cfg, Counter(map(tuple, answers))) > P_FLOOR


def test_the_test_catches_batched_rows_that_share_their_draws(tmp_path, monkeypatch):
    """Rows of a batch that read one random draw: each row alone still follows the law, the sample
    does not (a batch is one answer many times)."""
    from specbench.decoding.decode import autoregressive_samples

    from ..helpers import LawLM, tiny_law_model

    cfg, model = Sampling(temperature=1.0), tiny_law_model(1, tmp_path)
    exact = decode.next_token
    monkeypatch.setattr(decode, "next_token", lambda logits, s, g: exact(logits[:1], s, g).expand(len(logits), 1))
    answers = autoregressive_samples(
        model, torch.tensor(PROMPT), SAMPLES, LENGTH, cfg, torch.Generator().manual_seed(0)
    )
    assert law_p(LawLM(model, packed=False), cfg, Counter(map(tuple, answers))) < P_FLOOR


@pytest.mark.parametrize("cfg", [Sampling(0.0), Sampling(0.0, repetition_penalty=1.6, logit_bias=((2, 0.5),))])
def test_the_baselines_batched_greedy_answers_equal_its_own_and_stop_where_it_does(tmp_path, cfg):
    from specbench.decoding.decode import autoregressive_samples

    from ..helpers import LawLM, tiny_law_model

    model, prompt = tiny_law_model(2, tmp_path), torch.tensor([0, 1, 2, 1])
    one = autoregressive_decode(LawLM(model, packed=False), prompt, 12, cfg, torch.Generator(), frozenset()).tokens
    stop = one[5]  # a token the answer reaches: both cut after its first appearance
    cut = one[: one.index(stop) + 1]
    rows = autoregressive_samples(model, prompt, 3, 12, cfg, torch.Generator(), frozenset({stop}))
    assert rows == [cut] * 3 and len(cut) < 12
