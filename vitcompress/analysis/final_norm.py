"""The final norm: the normalisation applied to the token stream after the last block.

Token distillation compares the student's and the teacher's tokens at its output, so it must be
a module that a forward hook can watch in both models. It is found by following the last block's
output forward through ops that keep the token stream's shape (B, N, C) to the first norm op
reading that stream: a layer/RMS/group norm call, or a call of such a module. What a module is
called plays no part; a stream that changes shape first (pooling, taking the cls token) has no
final norm on its tokens.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from vitcompress.analysis import ops


def find_final_norm(gm: fx.GraphModule, stream: fx.Node) -> str | None:
    """Module path of the norm applied to ``stream`` (the last block's output), or ``None``.

    ``None`` as well when the first such norm is not the whole output of one module (a
    functional call in a ``forward`` that goes on computing): a hook could not watch it.
    """
    shape = ops.shape(stream)
    carried = {stream}  # the stream and its shape-preserving continuations
    nodes = list(gm.graph.nodes)
    for node in nodes[nodes.index(stream) + 1 :]:
        inputs = [n for n in node.all_input_nodes if n in carried]
        if not inputs:
            continue
        if ops.is_norm(gm, node) and node.args and node.args[0] in carried:
            return _hooked_module(node, nodes)
        if ops.shape(node) == shape:
            carried.add(node)
    return None


def _hooked_module(norm: fx.Node, nodes: list[fx.Node]) -> str | None:
    """The module whose output is ``norm``'s: a module call itself, or the module a functional
    norm was traced in, when nothing of that module runs after it (bar taking the first item of
    an exported ``native_layer_norm``'s tuple)."""
    if norm.op == "call_module":
        return str(norm.target)
    path = ops.module_path(norm)
    if not path:
        return None
    for node in nodes[nodes.index(norm) + 1 :]:
        inside = ops.module_path(node)
        if inside != path and not inside.startswith(path + "."):
            continue
        takes_item = (
            node.op == "call_function" and node.target is operator.getitem and node.args[0] is norm
        )
        if not takes_item:
            return None
    return path
