"""Rewrite a captured graph to carry out a compression plan.

Three kinds of edits, all on the graph the analysis mapped:
- a reducer module on the residual stream, built by the plan's variant: before a block or after
  its attention residual add (``Variant.placement``); it returns ``(tokens, keep_mask,
  positions)``, and ``sizes`` too for a variant that tracks them (ToMe);
- the attention core of a block replaced by a hook that masks dropped keys while training a
  predictor variant, adds ``log(size)`` to the key logits after merges (proportional attention),
  and returns what the reducer after it takes (a token score, or the head-mean keys);
- wherever something reads a reduced stage's tokens by position (a grid op of a hybrid, the
  stage's exit grid, the model's output or a head: ``Block.readers``), a restore that brings the
  full token set back in the base's order (``modules/restore.py``), by the variant's
  ``restore_rule``; after a grid op that flattens back at the same resolution, the kept positions
  are gathered again. A rule that reads only the tokens where they are read (``host``, ``zero``)
  restores there; one that reads values recorded on the residual stream (``value``, ``delta``)
  restores the stream and recomputes the per-token ops between it and the reader on the copy.
Shapes are read at run time in the captured code, so blocks after a reducer accept fewer tokens.
A windowed block is reduced and restored within itself (``compilation/windows.py``); the graph
edits both parts share are in ``compilation/graph_edits.py``.
"""

from __future__ import annotations

__all__ = ["HOOK_PREFIX", "REDUCER_PREFIX", "RewriteError", "rewrite"]

import operator
from dataclasses import replace
from typing import Any

import torch.fx as fx
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.model_map import DIFFERENCE, Block, ModelMap
from vitcompress.compilation.graph_edits import copy_between, erase_unused, getitems, replace_uses
from vitcompress.compilation.naming import HOOK_PREFIX, REDUCER_PREFIX, RewriteError
from vitcompress.compilation.plan import Plan
from vitcompress.compilation.windows import WindowRewrites
from vitcompress.method.restore import RESTORES_ANYWHERE
from vitcompress.modules import MHAHook, SDPAHook, SoftmaxHook
from vitcompress.modules.grid import GridGather
from vitcompress.modules.position_tables import PositionGather
from vitcompress.modules.restore import TokenRestore
from vitcompress.variants import AFTER_ATTENTION, BEFORE_BLOCK
from vitcompress.variants.placement import ATTENTION_GIVES_KEYS


def _core_suffix(block: Block) -> str:
    """Hook names per core: a block's first attention core is ``attn{i}``, further cores
    (parallel attentions, differential attention's second softmax) ``attn{i}_{j}``."""
    for j, core in enumerate(block.parallel_cores, start=1):
        if core is block.attention:
            return f"_{j}"
    return ""


class _Rewriter(WindowRewrites):
    def __init__(self, gm: fx.GraphModule, model_map: ModelMap, plan: Plan) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.map = model_map
        self.plan = plan
        self.nodes = ops.nodes_by_name(gm.graph)
        # Registered up front: fx checks that a call_module target exists when it is created.
        self.hooks = nn.Module()
        self.reducers = nn.Module()
        gm.add_module(REDUCER_PREFIX, self.reducers)
        gm.add_module(HOOK_PREFIX, self.hooks)

    def _add_hook(self, name: str, module: nn.Module) -> str:
        # A name taken already (two readers of one block at one node) gets a number: add_module
        # would replace the first module, and its call would run the second's.
        taken, number = name, 1
        while taken in self.hooks._modules:
            taken, number = f"{name}_{number}", number + 1
        name = taken
        self.hooks.add_module(name, module)
        return f"{HOOK_PREFIX}.{name}"

    def run(self) -> fx.GraphModule:
        placement = self.plan.method.placement
        by_block = {loc.block: (i, loc) for i, loc in enumerate(self.plan.locations)}
        carrier = {block: loc.block for loc in self.plan.locations for block in loc.carried}
        window_traces: dict[int, fx.Node] = {}  # a windowed location's choice, to carry
        state = _Stream()
        stage = -1
        for block in self.map.blocks:
            if block.stage != stage:
                if stage >= 0:
                    self._restore_stage_exit(self.map.stages[stage], state)
                stage = block.stage
                state = _Stream(restores=self._stage_restores(stage))
            located = by_block.get(block.index)
            if block.windows is not None:  # reduced and restored within the block
                owner = None
                if located is not None:
                    window_traces[block.index] = self._reduce_in_windows(block, *located)
                    owner = located[1]
                elif block.index in carrier:
                    owner = by_block[carrier[block.index]][1]
                    self._carry_in_windows(block, window_traces[owner.block])
                if owner is not None and owner.carried_branches:
                    self._carry_per_token_after(
                        block, window_traces[owner.block], owner.carried_branches
                    )
                continue
            state.node = self.nodes[block.input_node]
            if located is not None and placement == BEFORE_BLOCK:
                self._insert_predictor(block, *located, state)
            self._gather_position_tables(block, "attention", state.positions)
            scoring = located is not None and placement == AFTER_ATTENTION
            score = self._hook_block_attention(
                block, state.keep_mask, scoring, state.positions, state.sizes
            )
            self._restore_grid_ops(block, "attention", state)
            state.node = self.nodes[block.attn_add_node]
            if scoring:  # the block's MLP already sees the reduced tokens
                self._insert_attention_reducer(block, *located, score, state)
            self._gather_position_tables(block, "mlp", state.positions)
            self._restore_grid_ops(block, "mlp", state)
            state.node = self.nodes[block.output_node]
            for reader in block.readers:
                self._restore_for(
                    reader.node,
                    reader.tokens_node,
                    state,
                    block.prefix_tokens,
                    f"restore{block.index}_{reader.node}",
                    f"{reader.what} at {reader.path}",
                    axis=reader.axis,
                    prefix_tokens=reader.prefix_tokens,
                )
        self._restore_stage_exit(self.map.stages[stage], state)
        self.graph.lint()
        self.gm.recompile()
        return self.gm

    def _stage_restores(self, stage: int) -> bool:
        """Whether anything reads the stage's tokens by position (its grid ops, its exit grid,
        the output or a head): then its reducers record what they remove."""
        blocks = [b for b in self.map.blocks if b.stage == stage]
        return self.map.stages[stage].exit_grid_node is not None or any(
            b.readers or b.grid_ops for b in blocks
        )

    def _restore_stage_exit(self, stage, state: _Stream) -> None:
        """Tokens leaving a reduced stage as a grid (next patch embedding, a dense head, pooled
        features) get the full grid back, in grid order."""
        if not state.reduced or stage.exit_grid_node is None:
            return
        where = f"stage {stage.index}'s exit grid"
        self._restore_for(
            stage.exit_grid_node,
            stage.exit_tokens_node,
            state,
            stage.prefix_tokens,
            f"exit{stage.index}",
            where,
        )

    def _restore_for(
        self,
        reader_name: str,
        tokens_name: str,
        state: _Stream,
        stream_prefix: int,
        name: str,
        where: str,
        axis: int = 1,
        prefix_tokens: int = 0,
        in_block: bool = False,
    ) -> None:
        """Make the node ``reader_name`` read the node ``tokens_name`` with the stage's full token
        set back, on ``axis`` after ``prefix_tokens`` (a no-op before any reduction in the
        stage). ``tokens`` derives from the residual stream ``state.node``
        through per-token ops; a rule that reads recorded stream values restores the stream and
        recomputes those ops on the copy, unless (``in_block``: a grid op inside a block) one of
        them is a layer, which would then run twice: there the variant's local rule restores
        where the tokens are read."""
        reader, tokens = self.nodes[reader_name], self.nodes[tokens_name]
        if not state.reduced or tokens not in reader.all_input_nodes:
            return  # nothing reduced yet, or already restored (CvT's q, k, v share one grid)
        method = self.plan.method
        rule = method.restore_rule
        stream = state.node
        if in_block and rule not in RESTORES_ANYWHERE:
            between = ops.ancestors(tokens) - ops.ancestors(stream)
            if any(ops.multiplies(self.gm, node) for node in between):
                rule = method.local_restore_rule
        anywhere = rule in RESTORES_ANYWHERE or tokens is stream
        module = TokenRestore(
            rule,
            prefix_tokens if anywhere else stream_prefix,
            axis if anywhere else 1,
            where=where,
        )
        target = self._add_hook(name, module)
        with self.graph.inserting_before(reader):
            if anywhere:
                restored = self.graph.call_module(target, (tokens, state.trace))
            else:
                restored_stream = self.graph.call_module(target, (stream, state.trace))
                restored = copy_between(self.graph, stream, tokens, restored_stream)
                if restored is None:
                    raise RewriteError(
                        f"{where} reads {tokens.name}, which does not come from the residual "
                        f"stream {stream.name} through per-token ops: the tokens cannot be "
                        f"restored there by {rule}; try --variant-arg "
                        f"restore={method.local_restore_rule}"
                    )
        reader.replace_input_with(tokens, restored)
        erase_unused(self.graph, tokens)

    def _insert_reducer(
        self,
        stream_name: str,
        index: int,
        module: nn.Module,
        args: tuple,
        state: _Stream,
        outputs: int = 4,
        only_into: str | None = None,
    ) -> list[fx.Node]:
        """Put ``module`` on the residual stream after ``stream_name``; what read the stream reads
        the reducer's tokens instead (with ``only_into``: only what leads to that node, the
        reduced block's output, so that a reader of the previous block's tokens keeps them).
        Returns its outputs after the tokens (keep_mask, positions[, sizes], trace); the stream
        state follows the reducer."""
        stream = self.nodes[stream_name]
        if state.restores:
            module.restore_rule = self.plan.method.restore_rule
            # A grid op inside a block may restore by the method's local rule instead (a layer
            # between it and the stream would run again): the record holds what either reads.
            module.also_restores = self.plan.method.local_restore_rule
        self.reducers.add_module(str(index), module)
        with self.graph.inserting_after(stream):
            reducer = self.graph.call_module(
                f"{REDUCER_PREFIX}.{index}", (stream, *args, state.trace)
            )
        tokens, *rest = getitems(self.graph, reducer, outputs)
        keep = {reducer}
        if only_into is not None:
            toward = ops.ancestors(self.nodes[only_into])
            keep |= {user for user in stream.users if user not in toward}
        replace_uses(stream, tokens, keep)
        state.node, state.trace, state.reduced = tokens, rest[-1], True
        return rest

    def _insert_predictor(self, block: Block, index: int, loc, state: _Stream) -> None:
        module = self.plan.method.build_reducer(block, loc, self.plan)
        state.keep_mask, state.positions, _ = self._insert_reducer(
            block.input_node,
            index,
            module,
            (state.keep_mask, state.positions),
            state,
            only_into=block.output_node,
        )

    def _insert_attention_reducer(
        self, block: Block, index: int, loc, score, state: _Stream
    ) -> None:
        """The reducer after the attention residual; the stream state follows it."""
        method = self.plan.method
        module = method.build_reducer(block, loc, self.plan)
        if method.tracks_sizes:
            _, state.positions, state.sizes, _ = self._insert_reducer(
                block.attn_add_node,
                index,
                module,
                (score, None, state.positions, state.sizes),
                state,
                outputs=5,
            )
            return
        _, state.positions, _ = self._insert_reducer(
            block.attn_add_node, index, module, (score, None, state.positions), state
        )

    def _hook_block_attention(
        self, block: Block, keep_mask, scoring: bool, *rest: Any
    ) -> fx.Node | None:
        """Hook every attention core of the block alike (parallel attentions, differential
        attention's two softmaxes: all masked in training); the token score is theirs combined
        as the block's map combines them (``parallel.py``)."""
        if scoring and block.score_blocker is not None:  # the plan refuses it: never a guess
            raise RewriteError(block.score_blocker)
        if (
            scoring
            and block.parallel_cores
            and self.plan.method.attention_gives == ATTENTION_GIVES_KEYS
        ):
            raise RewriteError(
                f"block {block.index} ({block.path}) has {1 + len(block.parallel_cores)} "
                f"attention cores; {self.plan.variant} reads one attention's keys, so it is "
                "refused there"
            )
        scores = [
            self._hook_attention(replace(block, attention=core), keep_mask, scoring, *rest)
            for core in [block.attention, *block.parallel_cores]
        ]
        if not scoring or len(scores) == 1:
            return scores[0]
        with self.graph.inserting_before(self.nodes[block.attn_add_node]):
            if block.score_combination == DIFFERENCE:  # A1 - c A2: the scores are linear in it
                coefficient = block.score_coefficient
                if isinstance(coefficient, str):
                    coefficient = self.nodes[coefficient]
                scaled = self.graph.call_function(operator.mul, (coefficient, scores[1]))
                return self.graph.call_function(operator.sub, (scores[0], scaled))
            total = scores[0]  # the mean over all the cores' heads
            for score in scores[1:]:
                total = self.graph.call_function(operator.add, (total, score))
            return self.graph.call_function(operator.truediv, (total, len(scores)))

    def _hook_attention(
        self, block: Block, keep_mask, scoring: bool, positions, sizes=None
    ) -> fx.Node | None:
        """Replace the block's attention core when it must mask keys, weigh merged keys by their
        sizes, or give the reducer after it what it takes (a score, or the keys)."""
        if keep_mask is None and sizes is None and not scoring:
            return None
        core = block.attention
        node = self.nodes[core.node]
        has_cls = self.map.cls_token and block.prefix_tokens > 0
        keys = scoring and self.plan.method.attention_gives == ATTENTION_GIVES_KEYS
        options = dict(
            prefix_tokens=block.prefix_tokens,
            has_cls=has_cls,
            score=scoring,
            grid=block.grid,
            keys=keys,
            key_pool=core.key_pool,
        )
        name = f"attn{block.index}{_core_suffix(block)}"
        if core.kind == "sdpa":
            target = self._add_hook(name, SDPAHook(**options))
            args = (*node.args[:3], keep_mask, *node.args[3:])
            kwargs = {**node.kwargs, "positions": positions, "sizes": sizes}
        elif core.kind in ("matmul_softmax", "einsum_softmax"):
            dim = ops.softmax_dim(self.gm, node)
            if dim not in (-1, 3):
                raise RewriteError(f"softmax over dim {dim} in {core.path}; expected the key dim")
            target = self._add_hook(name, SoftmaxHook(**options))
            args, kwargs = (node.args[0], keep_mask, positions), {"sizes": sizes}
            if keys:
                kwargs["keys"] = self._key_operand(core)
        else:  # a kept-whole nn.MultiheadAttention
            target = self._add_hook(name, MHAHook(**options))
            with self.graph.inserting_before(node):
                module = self.graph.get_attr(str(node.target))
            args = (module, *node.args[:3], keep_mask)
            kwargs = {**node.kwargs, "positions": positions, "sizes": sizes}
        with self.graph.inserting_after(node):
            hook = self.graph.call_module(target, args, kwargs)
        if not scoring:
            node.replace_all_uses_with(hook)
            self.graph.erase_node(node)
            return None
        if core.kind == "multihead_attention":
            out, weights, score = getitems(self.graph, hook, 3)
            # Users index the original (output, weights) tuple; give them the same tuple back.
            with self.graph.inserting_after(weights):
                pair = self.graph.call_function(tuple, ([out, weights],))
            node.replace_all_uses_with(pair)
        else:
            out, score = getitems(self.graph, hook, 2)
            node.replace_all_uses_with(out)
        self.graph.erase_node(node)
        return score

    def _key_operand(self, core) -> fx.Node:
        """The keys of an explicit ``q @ k^T`` attention: the right operand of the product that
        feeds the softmax, laid out (..., D, N_keys) by the definition of a matrix product."""
        product = self.nodes.get(core.logits_node or "")
        if (
            product is None
            or core.kind != "matmul_softmax"
            or product.op not in ("call_function", "call_method")
            or len(product.args) != 2
            or not isinstance(product.args[1], fx.Node)
        ):
            raise RewriteError(
                f"the keys of {core.path} cannot be found (no plain query-key product feeds its "
                "softmax); a variant that matches on keys cannot use it"
            )
        return product.args[1]

    def _gather_position_tables(self, block: Block, branch: str, positions) -> None:
        """Make every position table that ``branch`` of a reduced block reads follow the kept
        tokens: the op reads the table gathered by the tokens' grid positions (PositionGather)
        instead (the plan refused the tables that cannot be gathered)."""
        if positions is None:
            return
        for number, use in enumerate(block.position_uses):
            if use.branch != branch:
                continue
            meeting, table = self.nodes[use.node], self.nodes[use.table_node]
            layout = use.gather_layout(len(ops.shape(meeting)), block.tokens, block.prefix_tokens)
            if use.blocker is not None or isinstance(layout, str):
                raise RewriteError(
                    f"the position table {use.table} of block {block.index} ({use.path}) cannot "
                    f"follow the kept tokens: {use.blocker or layout}"
                )
            dims, prefixes = layout
            module = PositionGather(dims, prefixes, len(ops.shape(meeting)), use.neutral)
            target = self._add_hook(f"positions{block.index}_{number}", module)
            with self.graph.inserting_before(meeting):
                gathered = self.graph.call_module(target, (table, positions))
            meeting.replace_input_with(table, gathered)

    def _restore_grid_ops(self, block: Block, branch: str, state: _Stream) -> None:
        """Give every grid op of a reduced block its full grid back (restored), then gather the
        present tokens again after a flatten at the same resolution."""
        if not state.reduced:
            return
        for op in block.grid_ops:
            if op.branch != branch:
                continue
            self._restore_for(
                op.to_grid_node,
                op.tokens_node,
                state,
                block.prefix_tokens,
                f"restore{block.index}_{op.op_node}",
                f"the {op.kind} {op.path} in block {block.index}",
                in_block=True,
            )
            if op.from_grid_node is not None:
                flat = self.nodes[op.from_grid_node]
                name = f"gather{block.index}_{op.op_node}"
                self.hooks.add_module(name, GridGather(grid=op.grid))
                with self.graph.inserting_after(flat):
                    gathered = self.graph.call_module(
                        f"{HOOK_PREFIX}.{name}", (flat, state.positions)
                    )
                replace_uses(flat, gathered, {gathered})


class _Stream:
    """The residual stream of the stage being rewritten, at the block being rewritten: its node
    and what the reductions so far hand on (keep mask, positions, sizes, trace)."""

    def __init__(self, restores: bool = False) -> None:
        self.restores = restores  # whether the stage's reducers record what they remove
        self.reduced = False  # whether a reducer precedes this point in the stage
        self.node: fx.Node | None = None
        self.keep_mask: Any = None
        self.positions: Any = None
        self.sizes: Any = None  # tokens' sizes after merges (ToMe), for proportional attention
        self.trace: Any = ()


def rewrite(gm: fx.GraphModule, model_map: ModelMap, plan: Plan) -> fx.GraphModule:
    """Apply ``plan`` to ``gm`` in place and return it."""
    if not model_map.has_nodes:
        raise RewriteError(
            "the model map names no graph nodes (it was read back from JSON); "
            "rewrite with the map the analysis of this graph made"
        )
    return _Rewriter(gm, model_map, plan).run()
