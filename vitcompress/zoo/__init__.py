"""Hybrid (convolution + attention) ViTs that timm does not ship, registered in timm's registry.

Importing this package registers ``pvt_tiny``, ``pvt_small``, ``pvt_medium``, ``pvt_large``,
``cvt_13``, ``cvt_21`` and ``cvt_w24`` so that ``timm.create_model(name, ...)`` builds them. See
``docs/zoo.md`` for sizes, costs and how to load the authors' checkpoints. It also registers
``segmenter_tiny_fmnist``, a small Segmenter (ViT + linear decoder, per-pixel logits) for the
generated ``fashion-mnist-seg`` set.

Written for graph rewriting: each model is ``torch.fx.symbolic_trace``-able, every token grid size
is read from tensor shapes at run time (never from config integers), and attention is an explicit
``q @ k^T -> softmax -> @ v`` so both graph analysis and ``FlopCounterMode`` see it. What the
families share is in ``_common``.
"""

from . import cvt, pvt, segmenter  # noqa: F401  (imported for the registration side effect)
from .cvt import ConvolutionalVisionTransformer
from .pvt import PyramidVisionTransformer
from .segmenter import Segmenter

__all__ = [
    "ConvolutionalVisionTransformer",
    "PyramidVisionTransformer",
    "Segmenter",
    "cvt",
    "pvt",
    "segmenter",
]
