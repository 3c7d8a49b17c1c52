"""Whether a model's residual branches are scaled near zero, so that its blocks barely move the
tokens and a compressed model's outputs match the base's whatever the method does.

LayerScale multiplies each residual branch by a learned per-channel vector, initialised tiny
(DINOv2 and CaiT: 1e-5). A model built with random weights keeps that init: every block returns
its input almost unchanged, any compression gives an output cosine of 1.000000 to the base and
the same top-1, and those numbers say nothing about the method. This is read off the model's
parameters, not its name: the per-channel scales are its one-dimensional parameters that are
neither a weight (a norm's, which starts at 1) nor a bias (named so, which starts at 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["NEAR_ZERO_SCALE", "NearZeroResiduals", "near_zero_residuals"]

# A residual branch scaled by no more than this changes a token by about a thousandth of the
# branch's output: trained LayerScales are 1e-2 to 1 and more, their init 1e-6 to 1e-4.
NEAR_ZERO_SCALE = 1e-3


@dataclass(frozen=True)
class NearZeroResiduals:
    """The model's per-channel residual scales, all of them at most :data:`NEAR_ZERO_SCALE`."""

    largest: float  # the largest |value| in any of them
    count: int  # how many scale vectors there are
    first: str  # the first one's name, to find them by

    def text(self) -> str:
        """One line for a report: what the scales are, and what that means for a comparison."""
        return (
            f"the base's {self.count} residual-branch scales ({self.first}, ...) are at most "
            f"{self.largest:.0e} (LayerScale at its initial value, as in a model with random "
            "weights): its blocks pass tokens on almost unchanged, so any compressed model's "
            "outputs match the base's (cosine ~1, the same top-1) and say nothing about the "
            "method; load trained weights (--pretrained, --checkpoint) to compare outputs"
        )


def _is_residual_scale(name: str, parameter: nn.Parameter) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    # Biases (a linear's, nn.MultiheadAttention's in_proj_bias, BEiT's q_bias) start at 0 and
    # weights (a norm's) at 1: neither scales a branch.
    named_otherwise = "bias" in leaf or "weight" in leaf
    return parameter.dim() == 1 and parameter.is_floating_point() and not named_otherwise


def near_zero_residuals(
    model: nn.Module, threshold: float = NEAR_ZERO_SCALE
) -> NearZeroResiduals | None:
    """:class:`NearZeroResiduals` when the model has per-channel residual scales and every one is
    at most ``threshold`` in magnitude; None when it has none, or any is larger."""
    scales = [(n, p) for n, p in model.named_parameters() if _is_residual_scale(n, p)]
    if not scales:
        return None
    largest = max(float(p.detach().abs().max()) for _, p in scales if p.numel())
    if largest > threshold:
        return None
    return NearZeroResiduals(largest=largest, count=len(scales), first=scales[0][0])
