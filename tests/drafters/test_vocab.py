"""Drafting across vocabularies (drafters/vocab.py): exact at T = 0 and T > 0, with broken controls;
greedy equal to the baseline; a run with a draft whose tokenizer is its own; what is refused."""

import json

import pandas as pd
import pytest
import torch

from specbench.decoding.decode import Draft, autoregressive_decode, speculative_decode
from specbench.decoding.sampling import Sampling, sample
from specbench.drafters.model import ModelDrafter
from specbench.drafters.vocab import TextDrafter
from specbench.methods.registry import universal_problem
from specbench.models.vocab import Bridge, VocabView, bridge_of

from ..helpers import CORPUS, build_llama, build_tokenizer, cli, cli_on_tiny_pair, one_line_error
from ..toy import P_FLOOR, PROMPT, ToyLM, chi_square_p

pytestmark = pytest.mark.usefixtures("one_thread")

# A target of three tokens and a draft of four: "a" and "b" are in both, the target's "ab" only in its
# own (the draft spells it "a", "b"), the draft's "ba" and "bb" only in the draft's.
TARGET_TEXTS, DRAFT_TEXTS = ["a", "b", "ab"], ["a", "b", "ba", "bb"]


def longest_match(texts: list[str]):
    """A tokenizer of ``texts``: the longest token that matches, left to right."""

    def encode(text: str) -> list[int]:
        ids = []
        while text:
            i = max((i for i, t in enumerate(texts) if text.startswith(t)), key=lambda i: len(texts[i]))
            ids.append(i)
            text = text[len(texts[i]) :]
        return ids

    return encode


def toy_bridge() -> Bridge:
    return Bridge(
        TARGET_TEXTS,
        DRAFT_TEXTS,
        longest_match(TARGET_TEXTS),
        longest_match(DRAFT_TEXTS),
        lambda ids: "".join(TARGET_TEXTS[i] for i in ids),
        lambda ids: "".join(DRAFT_TEXTS[i] for i in ids),
    )


def test_the_bridge_shares_the_tokens_of_one_text_and_spells_the_others():
    bridge = toy_bridge()
    assert bridge.to_draft == [0, 1, -1] and bridge.to_target == [0, 1, -1, -1] and bridge.shared == 2
    assert bridge.pieces(2) == [0, 1]  # "ab": the draft's "a", "b"
    assert bridge.draft_prompt([2, 0]) == [0, 2]  # "aba" tokenized whole: "a", "ba"
    assert bridge.target_ids([2, 3]) == [1, 2, 1]  # "babb" for the target: "b", "ab", "b"
    assert bridge.share([0, 2, 2, 1]) == 0.5 and bridge.spellable([0, 2]) == 1.0


def intersection(cfg: Sampling, generator: torch.Generator, drafter=ModelDrafter) -> ModelDrafter:
    return drafter(VocabView(ToyLM(len(DRAFT_TEXTS), seed=2), toy_bridge(), len(TARGET_TEXTS)), cfg, generator)


def text(cfg: Sampling, generator: torch.Generator, drafter=TextDrafter) -> TextDrafter:
    return drafter(ToyLM(len(DRAFT_TEXTS), seed=2), toy_bridge(), cfg, generator)


@pytest.mark.parametrize("make", [intersection, text], ids=["intersection", "text"])
@pytest.mark.parametrize(
    "cfg,k",
    [
        (Sampling(temperature=1.0), 2),
        pytest.param(Sampling(temperature=0.8, top_p=0.9), 3, marks=pytest.mark.slow),
    ],
)
def test_drafting_across_vocabularies_gives_the_target_law(make, cfg, k):
    generator = torch.Generator().manual_seed(0)
    # seed 0's target ranks its own-only "ab" high: only the residual (intersection) or text can give it.
    assert chi_square_p(ToyLM(len(TARGET_TEXTS), seed=1), make(cfg, generator), k, cfg) > P_FLOOR


class Spy:
    """A model whose forwards are recorded: ``rows`` is the last forward's logits."""

    def __init__(self, model):
        self.model, self.rows = model, None

    def forward(self, token_ids, last=1, positions=None, mask=None):
        self.rows = self.model.forward(token_ids, last)
        return self.rows

    def __getattr__(self, name):
        return getattr(self.model, name)


class QBeforeRenormalising(ModelDrafter):
    """A broken intersection: it draws from the restricted row but reports the draft's whole-vocabulary
    probabilities of the shared tokens (not renormalised over the intersection), so it under-states q
    and over-accepts."""

    def draw(self, logits, q):
        whole = self.model.draft.rows[-1].float().softmax(-1)
        reported = torch.zeros_like(q)
        reported[self.model.target_index] = whole[self.model.draft_index].to(q.dtype)
        return sample(q, self.generator), reported


def broken_intersection(cfg: Sampling, generator: torch.Generator) -> ModelDrafter:
    view = VocabView(Spy(ToyLM(len(DRAFT_TEXTS), seed=2)), toy_bridge(), len(TARGET_TEXTS))
    return QBeforeRenormalising(view, cfg, generator)


class TextWithDraftQ(TextDrafter):
    """A broken text drafter: it verifies each candidate against the draft's probability of the token it
    drew there, as if one tokenizer's probabilities held for the other's ids."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model, self.rows = Spy(self.model), []

    def propose(self, k):
        rows = []
        forward = self.model.forward

        def recorded(*args, **kwargs):
            out = forward(*args, **kwargs)
            rows.append(out[-1].float().softmax(-1))
            return out

        self.model.forward = recorded
        draft = super().propose(k)
        del self.model.forward
        q = torch.zeros(len(draft.tokens), len(TARGET_TEXTS))
        for i, token in enumerate(draft.tokens.tolist()):
            at = min(i, len(self.drafted) - 1)
            chance = float(rows[at][self.drafted[at]])
            q[i] = (1 - chance) / (len(TARGET_TEXTS) - 1)
            q[i, token] = chance
        return Draft.chain(draft.tokens, q, draft.forwards)


@pytest.mark.parametrize(
    "broken",
    [
        broken_intersection,
        lambda cfg, g: text(cfg, g, TextWithDraftQ),
    ],
    ids=["intersection-q-not-renormalised", "text-with-the-drafts-q"],
)
def test_the_law_test_catches_a_broken_drafter_across_vocabularies(broken):
    cfg = Sampling(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    drafter = broken(cfg, generator)
    p = chi_square_p(ToyLM(len(TARGET_TEXTS), seed=1), drafter, 2, cfg, negative_control=True)
    assert p < P_FLOOR


@pytest.mark.parametrize("make", [intersection, text], ids=["intersection", "text"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_drafting_across_vocabularies_equals_the_greedy_baseline(make, k):
    cfg = Sampling(temperature=0.0)
    for seed in range(4):
        target = ToyLM(len(TARGET_TEXTS), seed=seed)
        prompt = torch.tensor(PROMPT[: 1 + seed % 2])
        generator = torch.Generator().manual_seed(0)
        baseline = autoregressive_decode(target, prompt, 12, cfg, generator).tokens
        drafter = make(cfg, generator)
        assert speculative_decode(target, drafter, prompt, k, 12, cfg, generator).tokens == baseline


# ---------------------------------------------------------------- a pair of tiny models with tokenizers of their own


@pytest.fixture(scope="module")
def own_tokenizer_draft(tiny_pair, tmp_path_factory) -> str:
    """A draft for tiny_pair's target with a tokenizer of its own: trained on the same code, but a
    smaller vocabulary (so most of the target's merges are not its tokens)."""
    root = tmp_path_factory.mktemp("own-tokenizer")
    tokenizer = build_tokenizer(root / "tok", vocab_size=290)
    return str(build_llama(root / "draft", tokenizer, layers=1, hidden=32, seed=1))


def test_a_bridge_of_two_real_tokenizers(tiny_pair, own_tokenizer_draft):
    from transformers import AutoTokenizer

    target, draft = AutoTokenizer.from_pretrained(tiny_pair[0]), AutoTokenizer.from_pretrained(own_tokenizer_draft)
    bridge = bridge_of(target, draft, len(target) + 3, len(draft))  # the target's padding has no text
    ids = target.encode(CORPUS[3])
    assert 0.5 < bridge.share(ids) < 1.0 and bridge.spellable(ids) == 1.0
    assert draft.decode(bridge.draft_prompt(ids)) == CORPUS[3]
    assert [bridge.to_draft[i] for i in range(len(target), len(target) + 3)] == [-1] * 3
    eos = target.eos_token_id
    assert draft.convert_ids_to_tokens(bridge.to_draft[eos]) == "<eos>"  # specials are shared too


def run_args(target, draft, prompts_file, out, *more):
    return (
        "run", "--target", target, "--draft", draft, "--dataset", prompts_file, "--max-new-tokens", "20",
        "--cost-repeats", "2", "--threads", "1", "--out", str(out), *more,
    )  # fmt: skip


def test_a_run_drafts_across_vocabularies_with_its_columns(untied_target, own_tokenizer_draft, prompts_file, tmp_path):
    out = tmp_path / "run"
    methods = "speculative-intersection,speculative-text"
    # The untied target writes varied text, some of it in tokens the draft's vocabulary lacks.
    result = cli(*run_args(untied_target, own_tokenizer_draft, prompts_file, out, "--method", methods, "--k", "2,3"))
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv").set_index(["method", "k"], drop=False)
    records = pd.read_csv(out / "records.csv")
    assert records["outputs_match"].all()  # greedy: every prompt equal to the baseline
    crossing = summary[summary["method"] != "baseline"]
    assert len(crossing) == 4
    by_tokens = crossing[crossing["method"] == "speculative-intersection"]
    by_text = crossing[crossing["method"] == "speculative-text"]
    assert ((by_tokens["proposable"] > 0.2) & (by_tokens["proposable"] < 1)).all()
    assert (by_text["proposable"] == 1.0).all()
    assert summary.loc[summary["method"] == "baseline", "proposable"].isna().all()
    assert (crossing["retokenize_s"] > 0).all() and (crossing["tau"] >= 1).all()
    assert "retokenize ms" in result.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["methods"] == methods.split(",")


def test_transformers_universal_assisted_generation_is_a_compared_row(
    untied_target, own_tokenizer_draft, prompts_file, tmp_path
):
    out = tmp_path / "run"
    result = cli(
        *run_args(untied_target, own_tokenizer_draft, prompts_file, out, "--method", "hf-universal", "--k", "2")
    )
    if universal_problem(greedy=True):  # the oldest transformers pyproject allows (make test-lowest)
        one_line_error(result, "needs transformers 5.23 or later")
        return
    assert result.returncode == 0, result.stderr
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert list(summary.index) == ["baseline", "hf-generate", "hf-universal"]
    assert summary.loc["hf-universal", "outputs_match"] and summary.loc["hf-universal", "tau"] >= 1
    assert summary.loc["hf-universal", "draft_forwards"] > 0


def test_a_method_that_needs_the_targets_tokenizer_refuses_a_draft_with_its_own(
    tiny_pair, own_tokenizer_draft, prompts_file, tmp_path
):
    result = cli(
        *run_args(tiny_pair[0], own_tokenizer_draft, prompts_file, tmp_path / "run", "--method", "speculative")
    )
    one_line_error(result, "tokenizers", "differ", "--method speculative", "speculative-intersection")


def test_a_method_across_vocabularies_refuses_a_draft_that_shares_the_targets(tiny_pair, prompts_file, tmp_path):
    result = cli_on_tiny_pair(
        "run", tiny_pair, "--method", "speculative-text", "--dataset", prompts_file, "--out", str(tmp_path / "run")
    )
    one_line_error(result, "shares", "--method speculative runs this pair")


def digits_draft(tmp_path) -> str:
    """A draft whose vocabulary is digits alone: none of the target's code tokens but its end of text are its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["0123456789 31415926"] * 40, trainers.BpeTrainer(special_tokens=["<eos>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(tmp_path / "far")
    return str(build_llama(tmp_path / "far", tokenizer, layers=1, hidden=32, seed=1))


def test_a_draft_whose_vocabulary_shares_too_little_is_refused(tiny_pair, prompts_file, tmp_path):
    draft = digits_draft(tmp_path)
    result = cli(*run_args(tiny_pair[0], draft, prompts_file, tmp_path / "run", "--method", "speculative-text"))
    one_line_error(result, "of the prompts' tokens", "at least 50%")
    assert not (tmp_path / "run" / "summary.csv").exists()


def test_the_share_counts_every_users_turn_not_the_first_alone(tiny_pair, tmp_path):
    # First turns of digits, which the digits draft holds, then long later turns it holds none of:
    # counted over first turns alone the share passed, and the run drafted text it cannot read.
    later = "def fetch_user_record(identifier): return database.lookup(identifier)"
    rows = [{"turns": [f"{i} 31415926 0123456789 2718281828", later]} for i in range(3)]
    conversations = tmp_path / "turns.jsonl"
    conversations.write_text("".join(json.dumps(row) + "\n" for row in rows))
    draft = digits_draft(tmp_path)
    base = run_args(tiny_pair[0], draft, conversations, tmp_path / "run", "--method", "speculative-text")
    one_line_error(cli(*base, "--max-new-tokens", "4"), "of the prompts' tokens", "at least 50%")
    passes = cli(*run_args(tiny_pair[0], draft, conversations, tmp_path / "one", "--method", "speculative-text"),
                 "--max-turns", "1", "--max-new-tokens", "4")  # fmt: skip
    assert passes.returncode == 0, passes.stderr[-2000:]  # the first turns alone pass: the later ones refuse it


def test_universal_assisted_generation_under_sampling_is_refused_in_one_line(
    tiny_pair, own_tokenizer_draft, prompts_file, tmp_path
):
    args = run_args(tiny_pair[0], own_tokenizer_draft, prompts_file, tmp_path / "run", "--method", "hf-universal")
    one_line_error(cli(*args, "--temperature", "0.8"), "hf-universal")


def test_the_audit_takes_a_draft_with_its_own_tokenizer(untied_target, own_tokenizer_draft, prompts_file, tmp_path):
    result = cli(
        "audit", "--target", untied_target, "--draft", own_tokenizer_draft, "--dataset", prompts_file,
        "--method", "speculative-intersection,speculative-text", "--k", "2", "--setting", "greedy",
        "--prompts", "1", "--num-prompts", "2", "--greedy-tokens", "16", "--threads", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "audit.json").read_text())["rows"]
    greedy = {r["subject"]: r["verdict"] for r in rows if r["test"] == "greedy"}
    assert greedy == {
        "torch baseline (control)": "pass",
        "speculative-intersection K=2": "pass",
        "speculative-text K=2": "pass",
    }
