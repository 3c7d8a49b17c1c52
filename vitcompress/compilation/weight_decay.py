"""Which parameters are not weight-decayed, as facts about the model rather than guesses by name.

DeiT/timm do not decay norms, biases, position tables and prefix tokens. A compressed model is a
``torch.fx.GraphModule`` that keeps neither its base's class nor its ``no_weight_decay()``, so
the set is found at compression time and attached as ``vitcompress_no_weight_decay`` (exact
parameter names of the compressed model), which ``training/optim.py`` reads:

* the base's own ``no_weight_decay()`` where it has one (names or ``fnmatch`` patterns, as timm's
  optimizer factory reads them);
* else the parameters the captured graph adds or concatenates to the token stream with a leading
  dimension of 1 that becomes the batch: absolute position tables and prefix tokens, whatever
  they are called.

Parameters of one dimension or less (norm weights, biases, layer scales) are never decayed; that
rule needs no record.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn

NO_WEIGHT_DECAY_ATTRIBUTE = "vitcompress_no_weight_decay"

# Ops that only move, reshape, broadcast or cast a tensor: a parameter still is itself after them,
# even once broadcast to the batch (``cls_token.expand(B, -1, -1)``).
_SHAPE_OPS = frozenset(
    {
        "broadcast_to",
        "clone",
        "contiguous",
        "expand",
        "expand_as",
        "flatten",
        "float",
        "getitem",
        "permute",
        "repeat",
        "reshape",
        "squeeze",
        "tile",
        "to",
        "transpose",
        "type_as",
        "unsqueeze",
        "view",
        "_to_copy",
        "slice",
        "select",
        "alias",
    }
)
_ADD_OPS = frozenset({"add", "add_", "iadd"})
_CAT_OPS = frozenset({"cat", "concat", "concatenate"})
_MAX_STEPS = 64  # nodes followed from one parameter before giving up (resampling a table, ...)


def _op_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None  # a module call transforms its input: what comes out is no longer the table
    # operator.add -> "add", torch.cat -> "cat", aten.add.Tensor (torch.export) -> "add"
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def _batch_shaped(node: fx.Node, batch: int) -> bool:
    shape = node.meta.get("shape")
    return (
        isinstance(shape, tuple)
        and len(shape) >= 3
        and isinstance(shape[0], int)
        and shape[0] == batch
    )


def _meets_token_stream(start: fx.Node, batch: int) -> bool:
    """True if the value of ``start`` reaches an add or a concatenation whose result is the
    batch's (B, N, D) tokens (or (B, C, H, W) grid) through parameter-only computation."""
    seen = {start}
    frontier = [start]
    steps = 0
    while frontier and steps < _MAX_STEPS:
        node = frontier.pop()
        for user in node.users:
            steps += 1
            if user in seen:
                continue
            seen.add(user)
            name = _op_name(user)
            if name is None:
                continue
            if name in _ADD_OPS | _CAT_OPS and _batch_shaped(user, batch):
                return True
            # Still the table (not yet met by the image): follow it. Once it has met the batch,
            # only a pure shape op keeps it the same tensor (a product with the tokens does not).
            if not _batch_shaped(user, batch) or name in _SHAPE_OPS:
                frontier.append(user)
    return False


def token_stream_parameters(gm: fx.GraphModule, batch: int) -> set[str]:
    """Names (in ``gm``) of parameters with a leading dimension of 1 that the graph adds or
    concatenates to the token stream: position tables and prefix tokens. ``gm`` must carry the
    ``meta["shape"]`` of a capture on an example of ``batch`` images (batch > 1)."""
    parameters = dict(gm.named_parameters())
    found = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in parameters:
            continue
        tensor = parameters[node.target]
        if tensor.ndim >= 2 and tensor.shape[0] == 1 and _meets_token_stream(node, batch):
            found.add(str(node.target))
    return found


def declared_no_weight_decay(model: nn.Module) -> Callable[[str], bool] | None:
    """The model's own ``no_weight_decay()`` as a test on parameter names, or None if it has
    none. Entries are names or ``fnmatch`` patterns, as timm's optimizer factory reads them."""
    declare = getattr(model, "no_weight_decay", None)
    if not callable(declare):
        return None
    patterns = {str(p) for p in declare()}
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def no_weight_decay_parameters(
    base: nn.Module, captured: fx.GraphModule, batch: int
) -> list[torch.Tensor]:
    """The parameters of ``captured`` (a capture of ``base`` on ``batch`` images, before any
    rewrite) that are not decayed besides those of one dimension or less.

    The base's ``no_weight_decay()`` names base parameters; the capture copied them under the same
    qualified names, which is checked (same shape and values) before one is taken."""
    declared = declared_no_weight_decay(base)
    if declared is None:
        own = dict(captured.named_parameters())
        return [own[name] for name in sorted(token_stream_parameters(captured, batch))]
    base_params = dict(base.named_parameters())
    return [
        p
        for name, p in captured.named_parameters()
        if declared(name)
        and name in base_params
        and base_params[name].shape == p.shape
        and torch.equal(base_params[name].detach().cpu(), p.detach().cpu())
    ]


def parameter_names(model: nn.Module, tensors: list[torch.Tensor]) -> list[str]:
    """The names under which ``model`` holds ``tensors`` (the rewrite works in place, so the
    compressed model holds the captured parameters themselves)."""
    wanted = {id(t) for t in tensors}
    return sorted(
        name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted
    )
