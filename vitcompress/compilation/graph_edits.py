"""Small edits of an fx graph shared by the rewrites: unpacking a module's tuple output, moving
uses to a new node, copying a run of ops onto another input, erasing what nothing reads."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from vitcompress.analysis import ops


def getitems(graph: fx.Graph, node: fx.Node, count: int) -> list[fx.Node]:
    """``node[0]``, ..., ``node[count - 1]`` as nodes right after ``node`` (a reducer's tuple)."""
    items = []
    with graph.inserting_after(node):
        for i in reversed(range(count)):
            items.append(graph.call_function(operator.getitem, (node, i)))
    return list(reversed(items))


def replace_uses(old: fx.Node, new: fx.Node, keep: set[fx.Node]) -> None:
    """Every user of ``old`` reads ``new`` instead, but those in ``keep`` (the nodes that make
    ``new`` from ``old``)."""
    old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in keep)


def erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it any more, and so on up its inputs: the ops whose reduced
    result a reader no longer reads (a dense head's per-token linear, now run on the restored
    copy) must not run too. Impure ops (asserts) stay."""
    frontier = [node]
    erased: set[fx.Node] = set()  # an input shared by two erased nodes comes up twice
    while frontier:
        node = frontier.pop()
        if node in erased or node.users or node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        frontier.extend(inputs)


def copy_between(graph: fx.Graph, stream: fx.Node, tokens: fx.Node, restored: fx.Node) -> fx.Node:
    """Copy the ops from ``stream`` to ``tokens`` (those of ``tokens``'s ancestors that depend on
    ``stream``) at the insertion point, reading ``restored`` in place of ``stream``; returns the
    copy of ``tokens`` (``None`` when ``tokens`` does not depend on ``stream``)."""
    wanted = ops.ancestors(tokens)
    depends: set[fx.Node] = {stream}
    env: dict[fx.Node, fx.Node] = {stream: restored}
    started = False
    for node in list(graph.nodes):
        if node is stream:
            started = True
            continue
        if not started or node not in wanted:
            continue
        if any(parent in depends for parent in node.all_input_nodes):
            depends.add(node)
            env[node] = graph.node_copy(node, lambda arg: env.get(arg, arg))
        if node is tokens:
            break
    return env.get(tokens)


def devices_follow_input(gm: fx.GraphModule, device: torch.device) -> int:
    """Make every device literal equal to the capture's ``device`` the input's device, read at
    run time; returns how many were replaced. Capturing keeps the device a model reads from a
    buffer while tracing (timm's rotary embeddings: ``self.periods.device``) as a constant, so a
    compressed model moved to a GPU would still build those tensors on the capture's device."""
    graph = gm.graph
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    source: fx.Node | None = None
    replaced = 0

    def swap(value: object) -> object:
        nonlocal source, replaced
        if isinstance(value, torch.device) and value == device:
            if source is None:
                with graph.inserting_after(placeholder):
                    source = graph.call_function(getattr, (placeholder, "device"))
            replaced += 1
            return source
        if isinstance(value, tuple | list):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    for node in list(graph.nodes):
        if node is not source:
            node.args, node.kwargs = swap(node.args), swap(node.kwargs)
    if replaced:
        gm.recompile()
    return replaced
