"""The class logits of a model's output, as every measurement and workflow reads them."""

from __future__ import annotations

from typing import Any

import torch


def unwrap_logits(output: Any) -> torch.Tensor:
    """The class logits of a model's output: some heads return (logits, distillation logits) in
    training mode, and the first is the class head."""
    return output[0] if isinstance(output, tuple | list) else output
