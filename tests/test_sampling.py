"""logits_to_probs: each filter keeps what it promises, per row, at every position."""

import pytest
import torch

from specdecode import SamplingParams, SpecDecodeError
from specdecode.core.sampling import Warp, logits_to_probs

LOGITS = torch.tensor([[[3.0, 2.0, 1.0, 0.0, -1.0]]], dtype=torch.float64)


def probs(**kw) -> torch.Tensor:
    return logits_to_probs(LOGITS, Warp.from_params([SamplingParams(**kw)]))[0, 0]


def test_temperature_zero_is_one_hot_on_argmax():
    assert probs(temperature=0).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_temperature_one_is_softmax():
    assert torch.allclose(probs(temperature=1.0), torch.softmax(LOGITS[0, 0], -1))


def test_top_k_keeps_k_tokens_renormalised():
    p = probs(top_k=2)
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert float(p.sum()) == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(LOGITS[0, 0], -1)  # 0.636, 0.234, 0.086, ...
    assert (probs(top_p=0.6) > 0).sum() == 1
    assert (probs(top_p=0.8) > 0).sum() == 2
    assert (probs(top_p=float(full[:2].sum()) + 1e-9) > 0).sum() == 3


def test_min_p_drops_tokens_below_fraction_of_top():
    p = probs(min_p=0.3)  # keeps tokens with prob >= 0.3 * 0.636
    assert (p > 0).tolist() == [True, True, False, False, False]


def test_rows_and_positions_warp_independently():
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=2), SamplingParams(temperature=0), SamplingParams(top_p=0.5, min_p=0.1)]
    together = logits_to_probs(logits, Warp.from_params(params))
    for b, prm in enumerate(params):
        alone = logits_to_probs(logits[b : b + 1], Warp.from_params([prm]))
        assert torch.allclose(together[b], alone[0])
    assert ((together[0] > 0).sum(-1) == 2).all()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("max_new_tokens", 0),
        ("top_k", -1),
        ("top_k", 2**70),
    ],
)
def test_bad_sampling_params_raise_clear_errors(field, value):
    with pytest.raises(
        SpecDecodeError, match=field.replace("_", "-").replace("max-new-tokens", "max-new-tokens")
    ):
        SamplingParams(**{field: value})
