"""The two patterns a ViT's blocks are found from: attention cores (a fused SDPA call, a softmax
whose logits come from a matmul/einsum, a kept-whole ``nn.MultiheadAttention``) and residual adds
``add(skip, branch)`` of two (B, N, C) tensors where ``skip`` is an ancestor of ``branch`` (in a
post-norm block, ``norm(skip + branch)``, ending at the norm); with the data ancestry
(``Ancestry``) both are read from. ``analyse.py`` builds blocks and stages from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import Tensor, nn

from vitcompress.analysis import ops
from vitcompress.analysis.model_map import AttentionCore, KeyPool


@dataclass
class Residual:
    add: fx.Node
    skip: fx.Node
    branch: fx.Node
    nodes: list[fx.Node]  # nodes strictly inside the residual branch, in graph order


class Ancestry:
    """Data ancestors of every node as integer bitsets (graphs have a few thousand nodes).

    Only edges that carry tensors count: ``cls_token.expand(x.shape[0], -1, -1)`` reads the image
    batch's size but none of its data, so the cls token does not derive from the image.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = ops.nodes_by_name(graph)
        self.bits: dict[fx.Node, int] = {}
        for n in self.nodes:
            acc = 0
            for parent in n.all_input_nodes:
                if parent.meta.get("carries_tensor", True):
                    acc |= self.bits[parent] | (1 << self.index[parent])
            self.bits[n] = acc

    def is_ancestor(self, a: fx.Node, b: fx.Node) -> bool:
        return bool(self.bits[b] >> self.index[a] & 1)

    def between(self, start: fx.Node, end: fx.Node) -> list[fx.Node]:
        """Nodes that depend on ``start`` and that ``end`` depends on (both excluded)."""
        lo, hi = self.index[start], self.index[end]
        return [
            n
            for n in self.nodes[lo + 1 : hi]
            if self.is_ancestor(start, n) and self.is_ancestor(n, end)
        ]


@dataclass(frozen=True)
class GraphFacts:
    """The captured graph as the block passes read it: the module, the example it was captured
    with, the image batch (the leading dim of the image's tensor) and the nodes' ancestry."""

    gm: fx.GraphModule
    example: Tensor
    image_batch: int
    anc: Ancestry


def find_attention_cores(gm: fx.GraphModule) -> list[AttentionCore]:
    cores: list[AttentionCore] = []
    for node in gm.graph.nodes:
        if ops.is_sdpa(node):
            q, k = node.args[0], node.args[1]
            q_shape, k_shape = ops.shape(q), ops.shape(k)
            if q_shape is None or len(q_shape) != 4:
                continue
            cores.append(
                AttentionCore(
                    "sdpa",
                    node.name,
                    q_shape[1],
                    ops.module_path(node),
                    query_tokens=q_shape[2],
                    key_tokens=k_shape[2],
                    batch=q_shape[0],
                    key_pool=_key_pool(gm, k, q_shape[2], k_shape[2]),
                )
            )
        elif ops.is_softmax(node, gm):
            logits = node.args[0]
            logits_shape = ops.shape(logits)
            if logits_shape is None or len(logits_shape) != 4:
                continue
            product = ops.walk_back(logits, lambda n: ops.is_matmul(n) or ops.is_einsum(n), 8)
            if product is None:
                continue
            kind = "einsum_softmax" if ops.is_einsum(product) else "matmul_softmax"
            cores.append(
                AttentionCore(
                    kind,
                    node.name,
                    logits_shape[1],
                    ops.module_path(node),
                    logits_node=product.name,
                    query_tokens=logits_shape[2],
                    key_tokens=logits_shape[3],
                    batch=logits_shape[0],
                    key_pool=_key_pool(gm, product.args[-1], logits_shape[2], logits_shape[3])
                    if ops.is_matmul(product)
                    else None,
                )
            )
        elif ops.is_multihead_attention(gm, node):
            mha = gm.get_submodule(node.target)
            tokens_shape = ops.shape(node.args[0])
            n_tokens = None
            if tokens_shape is not None:
                n_tokens = tokens_shape[1] if mha.batch_first else tokens_shape[0]
            cores.append(
                AttentionCore(
                    "multihead_attention",
                    node.name,
                    mha.num_heads,
                    str(node.target),
                    query_tokens=n_tokens,
                    key_tokens=n_tokens,
                )
            )
    return cores


_KEY_POOLS = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)


def _key_pool(
    gm: fx.GraphModule, keys: object, query_tokens: int, key_tokens: int
) -> KeyPool | None:
    """Where an attention's keys are pooled on the token grid (fewer keys than queries), the
    strided conv or pool that made their grid: its kernel, stride and padding, walked back to
    from the keys through the ops between (a norm, a projection, layout, and a ``cat`` that puts
    prefix keys in front of the pooled ones, CvT's last stage); ``None`` where none is found (an
    adaptive pool, a functional conv), and the score of a key then covers its cell."""
    if not isinstance(keys, fx.Node) or key_tokens >= query_tokens:
        return None
    node = keys
    pooled_tokens = key_tokens  # the keys the pool makes: all, less those a cat put beside them
    for _ in range(24):
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, _KEY_POOLS):
            shape = ops.shape(node)
            if shape is None or len(shape) != 4 or shape[2] * shape[3] != pooled_tokens:
                return None
            kernel = nn.modules.utils._pair(module.kernel_size)
            stride = nn.modules.utils._pair(module.stride or module.kernel_size)
            # A dilated or string-padded op reads other tokens than kernel, stride and padding
            # say: no key pool, each key then stands for its cell.
            if isinstance(module.padding, str) or getattr(module, "dilation", 1) not in (1, (1, 1)):
                return None
            if stride != (1, 1):  # a stride-1 conv after the pool (PVTv2's) keeps its grid
                return kernel, stride, nn.modules.utils._pair(module.padding)
        if ops.is_cat(node):
            parts, sizes = _cat_parts(node)
            if parts and sum(sizes) == pooled_tokens:
                # A cat along the keys: the pooled keys are its largest part, the others (a cls
                # token's key) stand on no cell of the pooled grid. They must come first, as
                # the prefix tokens do: pooled keys with keys after them are not spread.
                largest = max(range(len(parts)), key=sizes.__getitem__)
                if largest != len(parts) - 1:
                    return None
                node, pooled_tokens = parts[largest], sizes[largest]
                continue
            # A cat along another axis (channels): the way back as through any op.
        # The data's way back: a tuple of tensors (``unbind``'s) has no shape but carries them;
        # a size read off a tensor carries none.
        parents = [
            p
            for p in node.all_input_nodes
            if p.op != "get_attr" and p.meta.get("carries_tensor", True)
        ]
        if not parents:
            return None
        node = parents[0]
    return None


def _cat_parts(node: fx.Node) -> tuple[list[fx.Node], list[int]]:
    """A ``cat``'s inputs and their sizes along its dim; empty where a shape is unknown."""
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or not isinstance(dim, int):
        return [], []
    shapes = [ops.shape(part) if isinstance(part, fx.Node) else None for part in parts]
    if any(shape is None or not -len(shape) <= dim < len(shape) for shape in shapes):
        return [], []
    return list(parts), [shape[dim] for shape in shapes]


@dataclass
class WindowAxisAttention:
    """Attention within windows laid on an axis of their own: logits (B, heads, T, N, N), the
    images' batch first, then the heads, the T windows and the N tokens of a window (NesT's
    blocks, Hiera's mask units), where a windowed core folds the windows into the batch."""

    node: fx.Node
    path: str
    windows: int
    tokens: int


def find_window_axis_attention(gm: fx.GraphModule, image_batch: int) -> list[WindowAxisAttention]:
    """Every softmax over 5-D logits from a product, or SDPA on 5-D queries, whose batch is the
    images' and whose third dim (the windows) is more than one."""
    found = []
    for node in gm.graph.nodes:
        if ops.is_sdpa(node):
            shape = ops.shape(node.args[0])
        elif ops.is_softmax(node, gm):
            product = ops.walk_back(node.args[0], lambda n: ops.is_matmul(n) or ops.is_einsum(n), 8)
            shape = ops.shape(node.args[0]) if product is not None else None
        else:
            continue
        if shape is None or len(shape) != 5 or shape[0] != image_batch or shape[2] < 2:
            continue
        found.append(WindowAxisAttention(node, ops.module_path(node), shape[2], shape[3]))
    return found


def find_residuals(gm: fx.GraphModule, anc: Ancestry) -> list[Residual]:
    residuals = []
    for node in gm.graph.nodes:
        if not ops.is_add(node):
            continue
        out = ops.shape(node)
        args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if out is None or len(out) != 3 or len(args) != 2:
            continue
        a, b = args
        if ops.shape(a) != out or ops.shape(b) != out:
            continue
        if anc.is_ancestor(a, b):
            skip, branch = a, b
        elif anc.is_ancestor(b, a):
            skip, branch = b, a
        else:
            continue
        inner = anc.between(skip, node)
        residuals.append(Residual(node, skip, branch, inner))
    return _through_post_norms(gm, residuals)


def _normalises_each_token(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A layer or RMS norm: each token on its own. A group norm on (B, N, C) would take the
    tokens as its channels."""
    if not ops.is_norm(gm, node):
        return False
    if node.op == "call_module":
        return not isinstance(gm.get_submodule(str(node.target)), nn.GroupNorm)
    return "group_norm" not in str(node.target)


def _through_post_norms(gm: fx.GraphModule, residuals: list[Residual]) -> list[Residual]:
    """A post-norm block (``norm1(x + attn(x))``, then ``norm2(h + mlp(h))``: torch's
    ``nn.TransformerEncoderLayer`` with ``norm_first=False``, BERT-style encoders) builds each
    residual on the norm after the previous one, not on its add. Such a residual is reported as
    ending at that norm, so blocks chain through it as through a plain add, and a reduction after
    the residual acts on the tokens the next residual reads. Only where the add's one user is
    that norm and the norm is the skip of another residual: a pre-norm model's last add feeding
    its final norm stays as it is."""
    skips = {r.skip for r in residuals}
    ended: list[Residual] = []
    for residual in residuals:
        users = [u for u in residual.add.users if u.meta.get("carries_tensor", True)]
        norm = users[0] if len(users) == 1 else None
        if (
            norm is not None
            and norm in skips
            and norm.args
            and norm.args[0] is residual.add
            and ops.shape(norm) == ops.shape(residual.add)
            and _normalises_each_token(gm, norm)
        ):
            residual = Residual(
                norm, residual.skip, residual.branch, [*residual.nodes, residual.add]
            )
        ended.append(residual)
    return ended
