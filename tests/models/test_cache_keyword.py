"""specbench passes a transformers model its KV cache by the name the model's forward declares, and
so sets off no deprecation warning on any transformers that pyproject allows.

transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``: the old name still works
there, through transformers' deprecate_kwarg, with a FutureWarning per call (67 in the fast suite),
and goes in 5.40; the output's field was renamed too. CI's pinned transformers is older, so these
tests build that rename themselves on the installed version, with transformers' own decorator, and
check that specbench's calls pass under warnings as errors. Where the installed transformers has the
rename already, the plain model checks the real thing as well."""

import inspect
import warnings
from dataclasses import dataclass

import pytest
import torch

from specbench.decoding.decode import autoregressive_samples
from specbench.decoding.sampling import Sampling
from specbench.models.lm import HFCausalLM


def renamed(model):
    """``model`` (a LlamaForCausalLM) behind a forward that takes its cache as ``cache`` and returns it
    as ``cache``, with ``past_key_values`` deprecated as transformers 5.24 deprecates it."""
    from transformers import LlamaForCausalLM
    from transformers.utils import ModelOutput
    from transformers.utils.deprecation import deprecate_kwarg

    # What the installed forward calls its cache: the renamed model hands it on under that name.
    installed = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

    @dataclass
    class Output(ModelOutput):
        logits: torch.Tensor | None = None
        cache: object = None

    class Renamed(LlamaForCausalLM):
        @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
        def forward(self, input_ids=None, cache=None, use_cache=None, logits_to_keep=0, **kwargs):
            out = super().forward(
                input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep, **{installed: cache}, **kwargs
            )
            return Output(logits=out.logits, cache=getattr(out, installed))

    model.__class__ = Renamed
    return model


@pytest.fixture(params=["installed", "renamed"])
def model(request, tmp_path):
    from ..helpers import tiny_law_model

    plain = tiny_law_model(3, tmp_path)
    return renamed(plain) if request.param == "renamed" else plain


@pytest.fixture
def deprecations_fail():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_the_keyword_is_the_one_the_forward_declares(model):
    from specbench.decoding.decode import cache_keyword

    keyword = cache_keyword(type(model))
    parameters = inspect.signature(type(model).forward).parameters
    assert keyword in parameters and keyword in ("cache", "past_key_values")
    assert keyword == "cache" or "cache" not in parameters


def test_specbench_model_calls_warn_of_no_deprecation(model, tmp_path, deprecations_fail):
    """The loop's model (models/lm.py: prefill, then a forward on its cache) and the baseline's batched
    samples (decoding/decode.py), against the same model's forward without a cache."""
    prompt = torch.tensor([0, 1, 2, 1])
    lm = HFCausalLM(model, width=3)
    lm.prefill(prompt)
    step = lm.forward(torch.tensor([2]), last=1)
    assert lm.length == 5
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([[0, 1, 2, 1, 2]]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(step[-1], whole)

    rows = autoregressive_samples(model, prompt, 2, 6, Sampling(0.0), torch.Generator())
    assert len(rows) == 2 and rows[0] == rows[1] and len(rows[0]) == 6
