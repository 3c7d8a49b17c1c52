"""A classifier head that fits the data: find the head of a compressed model, replace it with one
of the data's class count, and record the change so that the saved artifact rebuilds it.

The compressed model is a captured graph without timm's ``reset_classifier``, so its head is
found on the graph: the ``nn.Linear`` calls nearest to the output (a distilled DeiT has two, whose
mean is the output). Each is replaced as timm's ``reset_classifier`` does, by a fresh
``nn.Linear(in_features, classes)``. The artifact rebuilds its model from the base's source, so
the source records the new class count as the model argument ``num_classes``; a source that does
not build with it is refused before anything is trained.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from vitcompress.compilation.metadata import attach
from vitcompress.loading import LoadedModel, ModelLoadError, ModelSource, load_base_model
from vitcompress.training.evaluate import unwrap_logits
from vitcompress.training.run_directory import FinetuneError

__all__ = ["HeadChange", "HeadError", "classifier_heads", "fit_head", "model_outputs"]


class HeadError(FinetuneError):
    """A head that does not fit the data and cannot (or may not) be replaced."""


@dataclass(frozen=True)
class HeadChange:
    """What :func:`fit_head` did: the heads replaced (qualified names), the class counts before
    and after, and the source that rebuilds the model with the new head."""

    names: tuple[str, ...]
    before: int
    after: int
    source: ModelSource

    def line(self) -> str:
        """The one line a run prints about it."""
        heads = ", ".join(self.names)
        return (
            f"the model predicts {self.before} classes and the data has {self.after}: its head "
            f"({heads}) is replaced by a new {self.after}-class one (--keep-head refuses instead)"
        )


def model_outputs(model: nn.Module, image: torch.Tensor) -> int:
    """The number of logits ``model`` returns for one ``image`` (C, H, W), run in eval mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            return int(unwrap_logits(model(image.unsqueeze(0).to(device))).shape[-1])
    finally:
        model.train(was_training)


def classifier_heads(model: nn.Module, outputs: int) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules that produce the logits: on a captured graph,
    those nearest to the output along every path back from it; on a plain module, the one
    ``get_classifier()`` returns. Only linears with ``outputs`` outputs count."""
    graph = getattr(model, "graph", None)
    if not isinstance(graph, fx.Graph):
        getter = getattr(model, "get_classifier", None)
        head = getter() if callable(getter) else None
        names = [name for name, module in model.named_modules() if module is head]
        return names if isinstance(head, nn.Linear) and head.out_features == outputs else []
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    found: list[str] = []
    seen: set[fx.Node] = set()
    pending = list(output.all_input_nodes)
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if isinstance(module, nn.Linear):
                if module.out_features == outputs and str(node.target) not in found:
                    found.append(str(node.target))
                continue  # the head: what feeds it is the backbone
        if node.op in ("call_module", "call_function", "call_method"):
            pending.extend(node.all_input_nodes)
    return sorted(found)


def _rebuilt_source(
    source: ModelSource, names: list[str], classes: int, input_size: tuple[int, ...]
) -> ModelSource:
    """``source`` with ``num_classes=classes``, checked to build heads ``names`` of that size.

    No weights exist for a base with the new head, so the source names none (a checkpoint of the
    old head would not load into it)."""
    new = replace(
        source,
        model_args={**source.model_args, "num_classes": classes},
        checkpoint=None,
        pretrained=False,
    )
    try:
        base = load_base_model(new.spec, new.model_args, input_size=input_size).model
    except (ModelLoadError, TypeError, ValueError) as e:
        problem = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HeadError(
            f"cannot replace the head: {source.spec} does not build with "
            f"num_classes={classes} ({problem}); give the model a {classes}-class head "
            f"(e.g. --model-arg num_classes={classes}) or pass --keep-head"
        ) from e
    for name in names:
        try:
            head: Any = base.get_submodule(name)
        except AttributeError:
            head = None
        if not isinstance(head, nn.Linear) or head.out_features != classes:
            raise HeadError(
                f"cannot replace the head: {source.spec} built with num_classes={classes} has "
                f"no {classes}-class {name}; give the model a {classes}-class head yourself"
            )
    return new


def fit_head(
    student: LoadedModel, classes: int, image: torch.Tensor, keep_head: bool
) -> tuple[LoadedModel, HeadChange | None]:
    """``student`` with a head of ``classes`` outputs (``image``: one input, to count its
    outputs). Unchanged (and None) when it already has that many; refused when ``keep_head`` or
    when the head cannot be found or recorded. The new heads are drawn from torch's RNG."""
    model = student.model
    outputs = model_outputs(model, image)
    if outputs == classes:
        return student, None
    if keep_head:
        raise HeadError(
            f"the model predicts {outputs} classes but the data has {classes}, and --keep-head "
            "keeps its head: drop --keep-head to replace it"
        )
    names = classifier_heads(model, outputs)
    if not names:
        raise HeadError(
            f"the model predicts {outputs} classes but the data has {classes}, and no linear "
            f"head producing its {outputs} logits was found to replace; give it a "
            f"{classes}-class head (e.g. --model-arg num_classes={classes})"
        )
    source = _rebuilt_source(student.source, names, classes, student.input_size)
    for name in names:
        old = model.get_submodule(name)
        new = nn.Linear(old.in_features, classes, bias=old.bias is not None)
        new = new.to(device=old.weight.device, dtype=old.weight.dtype)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    attach(model, vitcompress_source=source)
    change = HeadChange(tuple(names), outputs, classes, source)
    return LoadedModel(model=model, source=source, input_size=student.input_size), change
