"""The inserted modules against their reference formulations."""

import torch

from vitcompress.modules.predictor import ScorePredictor


def _reference(predictor: ScorePredictor, tokens, keep_mask):
    """DynamicViT's PredictorLG, written out with the explicit concatenation."""
    x = predictor.in_conv(tokens)
    b, n, c = x.shape
    if keep_mask is None:
        global_ = x[..., c // 2 :].mean(dim=1, keepdim=True)
    else:
        w = keep_mask.unsqueeze(-1)
        global_ = (x[..., c // 2 :] * w).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True)
    return predictor.out_conv(torch.cat([x[..., : c // 2], global_.expand(b, n, c // 2)], -1))


def test_predictor_equals_dynamicvit_formulation():
    torch.manual_seed(0)
    predictor = ScorePredictor(32)
    tokens = torch.randn(3, 12, 32)
    mask = (torch.rand(3, 12) > 0.4).float()
    mask[:, 0] = 1.0
    torch.testing.assert_close(predictor(tokens), _reference(predictor, tokens, None))
    torch.testing.assert_close(predictor(tokens, mask), _reference(predictor, tokens, mask))


def test_keep_score_orders_like_the_keep_log_probability():
    torch.manual_seed(1)
    predictor = ScorePredictor(32)
    tokens = torch.randn(2, 50, 32)
    order = predictor.keep_score(tokens).argsort(dim=1)
    assert torch.equal(order, predictor(tokens)[..., 0].argsort(dim=1))


def test_dynamicvit_state_dict_layout():
    keys = set(ScorePredictor(16).state_dict())
    assert {
        "in_conv.0.weight",
        "in_conv.1.weight",
        "out_conv.0.weight",
        "out_conv.2.weight",
        "out_conv.4.weight",
    } <= keys
