"""Running a graph on token indices: which token each value holds after ops that move tokens.

The graph runs once on its example with token indices put in at some nodes; ops that work on
each token alone (norms, linears, drop paths) pass the indices through, every other op runs as it
is. What arrives where is then read off: a window's slots (``windows.py``), the images' and the
heads' order of an attention's batch (``attention_layouts.py``)."""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch import Tensor, nn

from vitcompress.analysis import ops

# Modules that act on each token alone: an index passes through them unchanged.
_PER_TOKEN_MODULES = (nn.LayerNorm, nn.Linear, nn.Dropout, nn.Identity, nn.GELU, nn.SiLU, nn.ReLU)


class IndexRun(fx.Interpreter):
    """Runs the graph on the example with token indices put in at some nodes (``seeds``); ops
    that work per token pass the indices through, every other op runs as it is. Records the
    values at ``wanted`` and stops when it has them all."""

    def __init__(
        self,
        gm: fx.GraphModule,
        seeds: dict[fx.Node, Tensor],
        wanted: set[fx.Node],
        in_place: set[fx.Node] = frozenset(),
        through_skip: dict[fx.Node, fx.Node] | None = None,
    ):
        super().__init__(gm)
        self.seeds = seeds
        self.wanted = wanted
        # Ops that keep every token at its place, read as passing the index on: a stride-1
        # conv over the grid that gives it back at its size (DaViT's and TinyViT's between
        # the attention and the MLP), and a sum of tensors that hold the same token everywhere.
        self.in_place = in_place
        # Residual adds whose index is their skip's: the branch runs on every token, whatever
        # it mixes (a channel attention between a windowed block and what follows it).
        self.through_skip = through_skip or {}
        self.found: dict[fx.Node, Tensor] = {}
        self.indexed: set[fx.Node] = set()  # nodes whose value is made of indices
        self.mixing: dict[fx.Node, str] = {}  # first op after a seed that is not per-token

    def run_node(self, n: fx.Node):
        if n in self.seeds:
            value = self.seeds[n]
            self.indexed.add(n)
        else:
            indexed = [a for a in n.all_input_nodes if a in self.indexed]
            skip = self.through_skip.get(n)
            if skip is not None and skip in self.indexed:
                value = self.env[skip].clone()
                self.indexed.add(n)
            elif indexed and n in self.in_place and not ops.is_layout(n):
                values = [self.env[a] for a in indexed]
                same = ops.shape(n) == ops.shape(indexed[0]) and all(
                    torch.equal(v, values[0]) for v in values[1:]
                )
                value = values[0].clone() if same else super().run_node(n)
                self.indexed.add(n)
                if not same:
                    self.mixing.setdefault(n, ops.module_path(n) or n.name)
            elif indexed and self._per_token(n):
                source = self.env[indexed[0]]
                out = ops.shape(n)
                value = source[..., :1].expand(*out).clone() if out is not None else source
                self.indexed.add(n)
            else:
                value = super().run_node(n)
                if indexed:
                    self.indexed.add(n)
                    if (
                        not ops.is_layout(n)
                        and n.op != "call_function"
                        or ops.multiplies(self.module, n)
                    ):
                        self.mixing.setdefault(n, ops.module_path(n) or n.name)
        if n in self.wanted:
            self.found[n] = value
            if len(self.found) == len(self.wanted):
                raise _Done
        return value

    def _per_token(self, n: fx.Node) -> bool:
        if ops.is_norm(self.module, n):
            return True
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            if isinstance(module, _PER_TOKEN_MODULES):
                return True
            taken = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            in_shape = ops.shape(taken) if taken is not None else None
            return _identity_in_eval(module, in_shape, ops.shape(n))
        return False


def _identity_in_eval(module: nn.Module, shape: tuple | None, out_shape: tuple | None) -> bool:
    """A parameterless module that returns its input in eval mode (a drop path). Probed at the
    input's shape, which must be the output's: an adaptive pool to 7 x 7 returns a 7 x 7 input
    as it is but pools an 8 x 8 one (CSATv2's spatial attention at 512 pixels)."""
    if shape is None or shape != out_shape or any(True for _ in module.parameters()):
        return False
    if module.training:
        return False
    probe = torch.randn(shape)
    try:
        with torch.no_grad():
            return torch.equal(module(probe), probe)
    except Exception:  # noqa: BLE001 - a module that cannot run alone is not an identity
        return False


class _Done(Exception):
    pass


def run_indices(
    gm: fx.GraphModule, example: Tensor, seeds, wanted, in_place=frozenset(), through_skip=None
) -> IndexRun:
    run = IndexRun(gm, seeds, set(wanted), set(in_place), through_skip)
    with torch.no_grad():
        try:
            run.run(example)
        except _Done:
            pass
    return run


def grid_index(
    shape: tuple[int, ...], offset: int = 1, dtype: torch.dtype = torch.float32
) -> Tensor:
    """A (B, ..., C) tensor whose every channel holds the token's flat index in its image's
    tokens plus ``b * tokens`` plus ``offset`` (0 is then free to mean padding); ``dtype`` the
    model's where it is double (its other operands, a table, are too)."""
    batch = shape[0]
    tokens = math.prod(shape[1:-1])
    index = torch.arange(batch * tokens, dtype=dtype) + offset
    return index.reshape(batch, *shape[1:-1], 1).expand(*shape).clone()


def holds_seed_tokens(values: Tensor | None, seed: Tensor) -> bool:
    """Whether ``values`` (any layout, channels last) hold ``seed``'s tokens, made by
    :func:`grid_index`, in ``seed``'s order: the same index at every token's place."""
    if values is None:
        return False
    expected = seed.reshape(seed.shape[0], -1, seed.shape[-1])[..., :1]
    if values.numel() // values.shape[-1] != expected.numel():
        return False
    return torch.equal(values.reshape(expected.shape[0], -1, values.shape[-1])[..., :1], expected)


def in_place_candidates(nodes) -> set[fx.Node]:
    """Of ``nodes``, those an index run may read as keeping every token at its place when they
    give back their input's shape (a conv over the grid, an activation on a (B, C, H, W) grid,
    a sum): not the layout ops, which run on the indices, nor the ops that move elements."""
    return {n for n in nodes if not ops.is_layout(n) and not ops.moves_elements(n)}
