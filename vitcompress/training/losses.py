"""The fine-tuning loss (docs/finetune.md):

    L = CE(soft targets) + ratio_weight * ratio + distill_weight * KL(teacher || student)
        + token_distill_weight * token distillation

``ratio`` and the token mask come from the keep masks that the learned reducers (dTPS, DynamicViT)
return in training; forward hooks read them so the compressed graph needs no extra outputs.

For segmentation (per-pixel logits (B, K, H, W), labels (B, H, W)) CE and KL are taken per pixel
and averaged over pixels and images; the ratio and token terms are the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import Tensor, nn

from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.rewrite import REDUCER_PREFIX
from vitcompress.data.segmentation import SEGMENTATION
from vitcompress.variants.base import RATIO_LOSS

log = logging.getLogger(__name__)


@dataclass
class LossWeights:
    ratio: float = 2.0
    distill: float = 0.5
    token_distill: float = 0.5


def ratio_loss(
    masks: list[Tensor | list[Tensor]], keep_ratios: list[float], prefix_tokens: list[int]
) -> Tensor:
    """Mean over locations s of mean over the batch of (mean over N0 of D_s - rho_s)^2. A
    location whose reducer ran on several groups of rows (padded windows, grouped by their token
    counts) gives a list of masks: the mean is then over every row of every group."""
    terms = []
    for mask, rho, prefix in zip(masks, keep_ratios, prefix_tokens, strict=True):
        groups = mask if isinstance(mask, list) else [mask]
        kept_share = torch.cat([group[:, prefix:].float().mean(dim=1) for group in groups])
        terms.append(((kept_share - rho) ** 2).mean())
    return torch.stack(terms).mean()


def kl_distillation(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher || student) on logits, temperature 1, summed over classes, averaged over images."""
    return F.kl_div(
        F.log_softmax(student_logits.float(), dim=-1),
        F.log_softmax(teacher_logits.float(), dim=-1),
        reduction="batchmean",
        log_target=True,
    )


def pixel_kl_distillation(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(teacher || student) of each pixel's class distribution ((B, K, H, W) logits,
    temperature 1), summed over classes, averaged over pixels and images."""
    kl = F.kl_div(
        F.log_softmax(student_logits.float(), dim=1),
        F.log_softmax(teacher_logits.float(), dim=1),
        reduction="none",
        log_target=True,
    )
    return kl.sum(dim=1).mean()


def token_distillation(
    student_tokens: Tensor, teacher_tokens: Tensor, keep: Tensor | None
) -> Tensor:
    """MSE between patch tokens at the positions kept at the end (``keep``: (B, N) bool), averaged
    over the kept tokens and channels; DynamicViT's token distillation."""
    diff = (student_tokens.float() - teacher_tokens.float()) ** 2
    if keep is None:
        return diff.mean()
    weight = keep.unsqueeze(-1).to(diff.dtype)
    denominator = weight.sum() * diff.shape[-1]
    if denominator == 0:  # nothing kept anywhere: no signal, but keep the graph connected
        return diff.sum() * 0.0
    return (diff * weight).sum() / denominator


@dataclass
class _Captured:
    masks: list[Tensor | list[Tensor] | None] = field(default_factory=list)
    student_tokens: Tensor | None = None
    teacher_tokens: Tensor | None = None
    positions: Tensor | None = None  # grid positions of the tokens after the last location


class DistillationTaps:
    """Forward hooks that record the reducers' keep masks and both models' final-norm tokens."""

    def __init__(self, student: nn.Module, teacher: nn.Module | None, token_distill: bool) -> None:
        self.captured = _Captured()
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        info = compression_info(student)
        self.variant: str = info.plan.variant if info is not None else ""
        tps = getattr(student, REDUCER_PREFIX, None)
        self.reducers = list(tps.children()) if isinstance(tps, nn.Module) else []
        # Only reducers that learn a keep mask get the ratio loss.
        self.learned = (
            info is not None
            and RATIO_LOSS in info.plan.method.losses
            and all(hasattr(r, "keep_ratio") for r in self.reducers)
            and bool(self.reducers)
        )
        self.captured.masks = [None] * len(self.reducers)
        if self.learned:
            for i, reducer in enumerate(self.reducers):
                self.handles.append(reducer.register_forward_hook(self._mask_hook(i)))
        # Prefix tokens at the final norm: a hybrid may add its cls token only in the last stage,
        # after the last location (PVT), so the last reducer's count is not always the one.
        blocks = info.model_map.blocks if info is not None else []
        self.final_prefix: int = (
            blocks[-1].prefix_tokens
            if blocks
            else self.reducers[-1].prefix_tokens
            if self.reducers
            else 0
        )
        self.norm_path: str | None = None
        self.token_distill = False
        self._graph_tap: tuple | None = None
        if token_distill and teacher is not None:
            self._tap_tokens(student, teacher)

    def _mask_hook(self, i: int):
        def hook(module: nn.Module, inputs: tuple, output: tuple) -> None:
            # Called once per group where a windowed block's padded windows are reduced group
            # by group (each group's windows hold another token count): every group's mask
            # counts. A mask of a count already held starts a new forward pass.
            mask, previous = output[1], self.captured.masks[i]
            groups = previous if isinstance(previous, list) else [previous]
            if mask is None or previous is None or any(g.shape[1] == mask.shape[1] for g in groups):
                self.captured.masks[i] = mask
            else:
                self.captured.masks[i] = [*groups, mask]

        return hook

    def _tap_tokens(self, student: nn.Module, teacher: nn.Module) -> None:
        # The analysis found the norm on the token stream after the last block, by the graph.
        info = compression_info(student)
        path = info.model_map.final_norm if info is not None else None
        student_tap = _graph_tap(student, path) if path else None
        teacher_norm = _submodule(teacher, path) if path else None
        if student_tap is None or teacher_norm is None:
            log.warning(
                "token distillation disabled: the final norm feeding the head was not "
                "found in both models"
            )
            return
        self.norm_path = path
        self.token_distill = True
        self._graph_tap = student_tap

        def save(attr: str):
            def hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
                setattr(self.captured, attr, output if isinstance(output, Tensor) else None)

            return hook

        self.handles.append(student_tap[0].register_forward_hook(save("student_tokens")))
        self.handles.append(teacher_norm.register_forward_hook(save("teacher_tokens")))
        if self.reducers:
            # Where the tokens left after the last location came from: eTPS/EViT drop tokens in
            # training too, and these grid positions pair them with the teacher's.
            def positions(module: nn.Module, inputs: tuple, output: tuple) -> None:
                self.captured.positions = output[2] if len(output) > 2 else None

            self.handles.append(self.reducers[-1].register_forward_hook(positions))

    def reset(self) -> None:
        self.captured.masks = [None] * len(self.reducers)
        self.captured.student_tokens = None
        self.captured.teacher_tokens = None
        self.captured.positions = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._graph_tap is not None and self._graph_tap[1] is not None:
            _remove_graph_tap(*self._graph_tap[1])
        self._graph_tap = None


TAP_NAME = "vitcompress_token_tap"


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _graph_tap(model: nn.Module, path: str) -> tuple[nn.Module, tuple | None] | None:
    """A module whose forward hook sees the output of the norm at ``path`` in ``model``.

    A plain module: the norm itself. A captured graph traces a LayerNorm into a ``layer_norm``
    call on ``get_attr`` weights, so there is no module call to hook; an ``nn.Identity`` call is
    inserted after that node instead (no parameters, so the state dict is unchanged) and taken out
    again by ``DistillationTaps.remove``.
    """
    graph = getattr(model, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        try:
            return model.get_submodule(path), None
        except AttributeError:
            return None
    found = None
    for node in graph.nodes:
        if node.op == "call_module" and node.target == path:
            found = node
        elif node.op in ("call_function", "call_method", "call_module"):
            inputs = [a for a in node.all_input_nodes if a.op == "get_attr"]
            if any(a.target in (f"{path}.weight", f"{path}.bias") for a in inputs):
                found = node
    if found is None:
        return None
    if found.op == "call_module":
        return model.get_submodule(path), None
    tap = nn.Identity()
    model.add_module(TAP_NAME, tap)
    with graph.inserting_after(found):
        tap_node = graph.call_module(TAP_NAME, (found,))
    found.replace_all_uses_with(tap_node, delete_user_cb=lambda user: user is not tap_node)
    model.recompile()
    return tap, (model, found, tap_node)


def _remove_graph_tap(model: nn.Module, found: torch.fx.Node, tap_node: torch.fx.Node) -> None:
    tap_node.replace_all_uses_with(found)
    model.graph.erase_node(tap_node)
    delattr(model, TAP_NAME)
    model.recompile()


class FinetuneLoss:
    """Computes the total loss and its parts from the outputs and what the taps recorded."""

    def __init__(
        self,
        taps: DistillationTaps,
        weights: LossWeights,
        mixup: bool,
        smoothing: float,
        task: str = "classification",
    ) -> None:
        self.taps = taps
        self.weights = weights
        self.segmentation = task == SEGMENTATION
        self.distillation = pixel_kl_distillation if self.segmentation else kl_distillation
        if self.segmentation:  # per pixel: (B, K, H, W) against (B, H, W); no mixup
            self.base: nn.Module = nn.CrossEntropyLoss(label_smoothing=smoothing)
        elif mixup:
            self.base = SoftTargetCrossEntropy()
        elif smoothing > 0:
            self.base = LabelSmoothingCrossEntropy(smoothing=smoothing)
        else:
            self.base = nn.CrossEntropyLoss()
        self._warned_tokens = False

    def __call__(
        self, logits: Tensor, target: Tensor, teacher_logits: Tensor | None
    ) -> tuple[Tensor, dict[str, float]]:
        parts: dict[str, Tensor] = {"ce": self.base(logits.float(), target)}
        taps, captured = self.taps, self.taps.captured
        masks = [m for m in captured.masks if m is not None]
        if self.weights.ratio and taps.learned and len(masks) == len(taps.reducers):
            parts["ratio"] = self.weights.ratio * ratio_loss(
                masks,
                [r.keep_ratio for r in taps.reducers],
                [r.prefix_tokens for r in taps.reducers],
            )
        if self.weights.distill and teacher_logits is not None:
            parts["distill"] = self.weights.distill * self.distillation(logits, teacher_logits)
        if self.weights.token_distill and taps.token_distill:
            term = self._token_term(masks)
            if term is not None:
                parts["token_distill"] = self.weights.token_distill * term
        total = torch.stack(list(parts.values())).sum()
        return total, {k: float(v.detach()) for k, v in parts.items()}

    def _token_term(self, masks: list[Tensor]) -> Tensor | None:
        captured = self.taps.captured
        student, teacher = captured.student_tokens, captured.teacher_tokens
        prefix = self.taps.final_prefix
        if student is not None and teacher is not None and student.dim() == 3:
            if student.shape == teacher.shape:  # nothing dropped (masks), or restored on the grid
                # The last keep mask describes these tokens only if it has one column per token:
                # a hybrid's later stage has a grid of its own.
                last = masks[-1] if masks and isinstance(masks[-1], Tensor) else None
                keep = (
                    last[:, prefix:] > 0.5
                    if last is not None and last.shape[1] == student.shape[1]
                    else None
                )
                return token_distillation(student[:, prefix:], teacher[:, prefix:].detach(), keep)
            paired = pair_by_position(
                student[:, prefix:], teacher[:, prefix:].detach(), captured.positions
            )
            if paired is not None:  # eTPS/EViT: tokens dropped, paired by grid position
                return token_distillation(student[:, prefix:], *paired)
        if not self._warned_tokens:
            log.warning(
                "token distillation skipped: the student's final tokens cannot be paired "
                "with the teacher's"
            )
            self._warned_tokens = True
        return None


def pair_by_position(
    student_tokens: Tensor, teacher_tokens: Tensor, positions: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """The teacher's token at the grid position of each student token, and which student tokens
    have one (EViT's fused token has position -1). None when the positions do not describe the
    student's tokens. Shapes: tokens (B, n, C) / (B, N0, C), positions (B, n)."""
    if (
        positions is None
        or positions.dim() != 2
        or positions.shape != student_tokens.shape[:2]
        or int(positions.max()) >= teacher_tokens.shape[1]
    ):
        return None
    on_grid = positions >= 0
    index = positions.clamp(min=0).unsqueeze(-1).expand(-1, -1, teacher_tokens.shape[-1])
    return torch.gather(teacher_tokens, 1, index), on_grid
