"""The rewrite of windowed blocks (Swin's and kin): the method reduces every window alike inside
the block, and every window gets its tokens back before they return to their places on the grid.

``WindowRewrites`` is a part of the rewriter (``rewrite._Rewriter``), kept apart because it is
one idea of its own: it uses the rewriter's graph, node table, plan, reducer and hook registries
(``graph``, ``nodes``, ``plan``, ``reducers``, ``_add_hook``) and its attention hooks
(``_hook_block_attention``, ``_hook_attention``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.model_map import Block, PerTokenBranch
from vitcompress.analysis.window_map import (
    QueryTermInput,
    ReducedAttention,
    SlotInput,
    SlotKind,
    WindowLayout,
    Windows,
)
from vitcompress.compilation.graph_edits import copy_between, erase_unused, getitems, replace_uses
from vitcompress.compilation.naming import REDUCER_PREFIX
from vitcompress.modules.restore import TokenRestore
from vitcompress.modules.windows import (
    WindowCarry,
    WindowMerge,
    WindowPartition,
    WindowQueryGather,
    WindowQueryScatter,
    WindowReplay,
    WindowScoreSlots,
    WindowSizes,
    WindowSlots,
    WindowTableGather,
)
from vitcompress.variants import BEFORE_BLOCK


class WindowRewrites:
    """The windowed blocks' part of the rewriter (a mixin of ``rewrite._Rewriter``)."""

    def _reduce_in_windows(self, block: Block, index: int, loc) -> fx.Node:
        """A windowed block (Swin's): its tokens go into the attention's windows, the method
        reduces every window alike, the block runs on what is kept, and restores give every
        window its tokens back before they return to their places.

        A method scored by the attention (or matching on its keys) reduces after it: the MLP
        runs on the kept tokens. A predictor reduces the windows entering the attention; the
        MLP's input is then reduced by the same choice (``WindowReplay``). Where the attention
        cannot run on fewer tokens (``WholeAttention``), a predictor chooses on the
        MLP's input instead and the attention runs whole. Returns the trace of the choice, for
        the blocks that carry it (:meth:`_carry_in_windows`)."""
        method = self.plan.method
        windows = block.windows
        module = method.build_reducer(block, loc, self.plan)
        module.restore_rule = method.restore_rule
        self.reducers.add_module(str(index), module)
        target = f"{REDUCER_PREFIX}.{index}"
        restore = self._window_restore(block)
        if method.placement == BEFORE_BLOCK and windows.attention_reducible:
            module.also_restores = method.local_restore_rule  # the window attention's restore
            trace = self._reduce_window_attention(block, target)
            restored, trace = self._replay_window_mlp(block, trace, restore)
            order = windows.order
        elif method.placement == BEFORE_BLOCK:
            # The attention cannot run on fewer tokens per window (padded windows, a table
            # that cannot follow them): it runs whole, and the predictor chooses on the MLP's
            # input, as an attention-scored method does after the attention. A carried block
            # after it may still reduce its attention: the choice records what that restores.
            module.also_restores = method.local_restore_rule
            restored, order, trace = self._reduce_window_groups(block, target, restore, None)
        else:
            given = self._hook_block_attention(block, None, True, None, None)
            if windows.score_slots is not None:  # a factorised attention's, in another order
                slots = self._add_hook(f"scoreslots{index}", WindowScoreSlots(windows.score_slots))
                with self.graph.inserting_after(given):
                    given = self.graph.call_module(slots, (given,))
            restored, order, trace = self._reduce_window_groups(block, target, restore, given)
        self._merge_windows(block, restored, order)
        return trace

    def _carry_in_windows(self, block: Block, trace: fx.Node) -> fx.Node:
        """A windowed block after a location, in the same windows (``Location.carried``): its
        attention runs on the tokens the location kept (where nothing in it is laid out by a
        position no gathered table follows, else it runs whole), then its MLP; each restores
        by the method's rules. Nothing is scored or fused here. Returns the trace."""
        restore = self._window_restore(block)
        if block.windows.attention_reducible:
            trace = self._reduce_window_attention(block, None, carried=trace)
        restored, trace = self._replay_window_mlp(block, trace, restore)
        self._merge_windows(block, restored, block.windows.order)
        return trace

    def _window_restore(self, block: Block) -> str:
        return self._add_hook(
            f"restore{block.index}",
            TokenRestore(
                self.plan.method.restore_rule,
                block.windows.prefix_tokens,
                1,
                where=f"block {block.index}'s windows",
            ),
        )

    def _replay_window_mlp(
        self, block: Block, trace: fx.Node, restore: str, branch: PerTokenBranch | None = None
    ) -> tuple[list[fx.Node], fx.Node]:
        """The MLP's input (or that of ``branch``, a per-token branch after the block) put in
        the windows and reduced by the choice ``trace`` records (``WindowReplay``), the MLP run
        on the kept tokens, restored. Returns the restored windows (one tensor) and the
        replay's trace."""
        windows = block.windows
        skip, add, name = self._residual_of(block, branch)
        rule = self.plan.method.restore_rule
        partition = self._add_hook(f"windows{name}", WindowPartition(windows.order, windows.count))
        replay = self._add_hook(f"replay{name}", WindowReplay(rule))
        with self.graph.inserting_before(add):
            in_windows = self.graph.call_module(partition, (skip,))
            replayed = self.graph.call_module(replay, (in_windows, trace))
            tokens = self.graph.call_function(operator.getitem, (replayed, 0))
            trace = self.graph.call_function(operator.getitem, (replayed, 1))
            out = copy_between(self.graph, skip, add, tokens)
            restored = [self.graph.call_module(restore, (out, trace))]
        return restored, trace

    def _merge_windows(
        self,
        block: Block,
        restored: list[fx.Node],
        order: tuple[int, ...],
        branch: PerTokenBranch | None = None,
    ) -> None:
        """Every window's tokens back at their places on the grid, as the block's output (or
        as ``branch``'s)."""
        windows = block.windows
        skip, add, name = self._residual_of(block, branch)
        merge = self._add_hook(f"unwindows{name}", WindowMerge(order, windows.count))
        with self.graph.inserting_before(add):
            joined = restored[0]
            if len(restored) > 1:  # padded windows, reduced by groups: (B, L, C) again
                joined = self.graph.call_function(torch.cat, (restored, 1))
            merged = self.graph.call_module(merge, (joined, skip))
        add.replace_all_uses_with(merged)
        erase_unused(self.graph, add)
        self.nodes[add.name] = merged  # what the map names by the add is now the merge

    def _residual_of(
        self, block: Block, branch: PerTokenBranch | None
    ) -> tuple[fx.Node, fx.Node, str]:
        """The skip and the add of the block's MLP residual, or of ``branch``, and a name for
        their hooks."""
        if branch is None:
            names = (block.windows.mlp_input_node, block.output_node, f"{block.index}")
        else:
            number = block.per_token_after.index(branch)
            names = (branch.input_node, branch.output_node, f"{block.index}_after{number}")
        return self.nodes[names[0]], self.nodes[names[1]], names[2]

    def _carry_per_token_after(self, block: Block, trace: fx.Node, paths: tuple[str, ...]) -> None:
        """The per-token branches after a block that reduces by a choice it makes or carries
        (``Block.per_token_after``: DaViT's channel blocks' MLPs), those the plan names
        (``Location.carried_branches``), reduced by that choice as a carried block's MLP is,
        and restored."""
        for number, branch in enumerate(block.per_token_after):
            if branch.path not in paths:
                continue
            restore = self._add_hook(
                f"restore{block.index}_after{number}",
                TokenRestore(
                    self.plan.method.restore_rule,
                    0,
                    1,
                    where=f"{branch.path}, after block {block.index}",
                ),
            )
            restored, _ = self._replay_window_mlp(block, trace, restore, branch)
            self._merge_windows(block, restored, block.windows.order, branch)

    def _reduce_window_groups(
        self, block: Block, target: str, restore: str, given: fx.Node | None
    ) -> tuple[list[fx.Node], tuple[int, ...], fx.Node]:
        """After the attention: the MLP's input in windows, each group of windows alike
        (``Windows.groups``: one group unless the windows are padded, then one per token count,
        so that no padding is kept, scored or fused), reduced by what the attention gave for
        those slots (a predictor, ``given`` ``None``, scores them itself), through the MLP,
        restored. Returns the restored tokens of each group (one
        tensor as the windows, or (B, tokens, C) per group where several), their tokens' order,
        and the last group's trace (the only one where the windows are not padded)."""
        windows = block.windows
        groups = windows.groups()
        total = windows.count * windows.tokens
        add = self.nodes[block.output_node]
        skip = self.nodes[windows.mlp_input_node]
        tracks_sizes = self.plan.method.tracks_sizes
        restored, order = [], ()
        grid = sum(len(tokens) for _, tokens in groups)
        for number, (slots, tokens) in enumerate(groups):
            count = len(slots) // group_tokens(windows, slots)  # windows in the group
            suffix = f"{block.index}" + (f"_{number}" if windows.padded else "")
            partition = self._add_hook(f"windows{suffix}", WindowPartition(tokens, count, grid))
            with self.graph.inserting_before(add):
                scores = given
                if windows.padded and given is not None:  # only the group's real slots
                    pick = self._add_hook(f"slots{suffix}", WindowSlots(slots, total, count))
                    scores = self.graph.call_module(pick, (given,))
                if given is None:  # a predictor: (tokens, keep_mask, positions, trace)
                    args = (None, None)
                elif tracks_sizes:
                    args = (scores, None, None, None)
                else:
                    args = (scores, None, None)
                in_windows = self.graph.call_module(partition, (skip,))
                reducer = self.graph.call_module(target, (in_windows, *args, ()))
                kept = self.graph.call_function(operator.getitem, (reducer, 0))
                trace = self.graph.call_function(operator.getitem, (reducer, -1))
                out = copy_between(self.graph, skip, add, kept)
                back = self.graph.call_module(restore, (out, trace))
                if windows.padded:  # (B * group windows, n, C) -> (B, group tokens, C)
                    back = self.graph.call_method("unflatten", (back, 0, (-1, count)))
                    back = self.graph.call_method("flatten", (back, 1, 2))
            restored.append(back)
            order += tokens
        return restored, order, trace

    def _reduce_window_attention(
        self, block: Block, target: str | None, carried: fx.Node | None = None
    ) -> fx.Node:
        """A predictor's reduction of the windows entering a windowed block's attention (the
        reducer ``target``), or the choice a location made carried to this block (its trace,
        ``carried``): the attention runs on the kept tokens of each window (what it reads by
        window slot made to follow them, the removed keys masked while training) and its output
        comes back to every token by the rule that reads only the output (host, else zero).
        Returns the trace."""
        windows = block.windows
        attention = windows.attention
        assert isinstance(attention, ReducedAttention)  # the callers check attention_reducible
        method = self.plan.method
        entering = self.nodes[attention.input_node]
        leaving = self.nodes[attention.output_node]
        window_shape = ops.shape(leaving)
        flat = entering
        # NesT's (B, windows, N, C): the windows as a batch; MaxViT's (B * windows, h, w, C):
        # the window's tokens as one axis. Either way (B * windows, N, C).
        flattened = (0, 1) if attention.layout is WindowLayout.WINDOW_AXIS else (1, -2)
        if len(ops.shape(entering)) > 3:
            with self.graph.inserting_after(entering):
                flat = self.graph.call_method("flatten", (entering, *flattened))
        with self.graph.inserting_after(flat):
            if carried is None:
                reducer = self.graph.call_module(target, (flat, None, None, ()))
            else:
                carry = self._add_hook(
                    f"carry{block.index}", WindowCarry(method.local_restore_rule)
                )
                reducer = self.graph.call_module(carry, (flat, carried))
        tokens, keep_mask, positions, trace = getitems(self.graph, reducer, 4)
        handed = self._hand_kept(attention.layout, windows, entering, tokens)
        replace_uses(entering, handed, {reducer, flat})
        kept = _KeptSlots(entering, flat, tokens, handed, positions)
        for kind, handle in _SLOT_HANDLERS.items():
            slots = [slot for slot in attention.slot_inputs if slot.kind is kind]
            for number, slot in enumerate(slots):
                handle(self, block, slot, number, kept)
        sizes = None
        # Each kept key weighed by the tokens squeezed into it: dTPS's window_sizes, and ToMe's
        # proportional attention over the tokens a location merged, carried.
        if method.window_sizes or (carried is not None and method.tracks_sizes):
            counter = self._add_hook(f"windowsizes{block.index}", WindowSizes())
            with self.graph.inserting_after(trace):
                sizes = self.graph.call_module(counter, (trace,))
        self._hook_attention(block, keep_mask, False, None, sizes)
        restore = self._add_hook(
            f"restore{block.index}_attention",
            TokenRestore(
                method.local_restore_rule, 0, 1, where=f"block {block.index}'s window attention"
            ),
        )
        # The attention kept the tokens flat (it reads its output's layout off its input); in
        # MaxViT's layout the restored windows are laid out as they were.
        with self.graph.inserting_after(leaving):
            out = self.graph.call_method("flatten", (leaving, *flattened))
        with self.graph.inserting_after(out):
            restored = self.graph.call_module(restore, (out, trace))
        with self.graph.inserting_after(restored):
            back = self.graph.call_method("reshape", (restored, -1, *window_shape[1:]))
        replace_uses(leaving, back, {out})
        return trace

    def _hand_kept(
        self, layout: WindowLayout, windows: Windows, entering: fx.Node, tokens: fx.Node
    ) -> fx.Node:
        """The kept tokens, (B * count, K, C), laid out as the attention takes its windows."""
        if layout is WindowLayout.BATCH:
            return tokens
        if layout is WindowLayout.WINDOW_AXIS:  # back to (B, windows, K, C)
            args = (tokens, 0, (-1, windows.count))
        else:  # it reads B, H, W, C off its input: K x 1 "windows"
            args = (tokens, 1, (-1,) + (1,) * (len(ops.shape(entering)) - 3))
        with self.graph.inserting_after(tokens):
            return self.graph.call_method("unflatten", args)

    def _read_full_window(
        self, block: Block, slot: SlotInput, number: int, kept: _KeptSlots
    ) -> None:
        """An op that must see the full window's sizes (what makes a term from the queries,
        guards, what follows the restored output) reads them off the windows as they came, not
        off the reduced windows handed to the attention."""
        user = self.nodes[slot.reader]
        for read in list(user.all_input_nodes):
            axis = ops.shape_read(read, kept.handed)
            if axis is None:
                continue
            if kept.shape is None:
                with self.graph.inserting_after(kept.entering):
                    kept.shape = self.graph.call_function(getattr, (kept.entering, "shape"))
            if axis not in kept.full_sizes:
                with self.graph.inserting_after(kept.shape):
                    kept.full_sizes[axis] = self.graph.call_function(
                        operator.getitem, (kept.shape, axis)
                    )
            user.replace_input_with(read, kept.full_sizes[axis])

    def _query_term_at_full_window(
        self, block: Block, slot: SlotInput, number: int, kept: _KeptSlots
    ) -> None:
        """A term made from the queries by window position made at the full window, from the
        kept queries put back in their slots, and its kept rows' kept columns handed to the
        attention."""
        assert isinstance(slot, QueryTermInput)
        windows = block.windows
        query = self.nodes[slot.queries]
        made = {self.nodes[name] for name in slot.makers}
        scatter = self._add_hook(f"windowqueries{block.index}", WindowQueryScatter(windows.tokens))
        with self.graph.inserting_after(query):
            queries = self.graph.call_module(scatter, (query, kept.positions))
        for user in list(query.users):
            if user in made:
                user.replace_input_with(query, queries)
        mask, core = self.nodes[slot.source], self.nodes[slot.reader]
        gather = self._add_hook(
            f"windowbias{block.index}", WindowTableGather(windows.count, slot.gather_dims[-1] + 1)
        )
        with self.graph.inserting_before(core):
            gathered = self.graph.call_module(gather, (mask, kept.positions))
        core.replace_input_with(mask, gathered)

    def _gather_query_rows(
        self, block: Block, slot: SlotInput, number: int, kept: _KeptSlots
    ) -> None:
        """Queries made without the window tokens (GCViT's global query): their rows by the
        kept slots."""
        query = self.nodes[slot.source]
        gather = self._add_hook(f"windowquery{block.index}", WindowQueryGather())
        with self.graph.inserting_after(query):
            gathered = self.graph.call_module(gather, (query, kept.positions))
        replace_uses(query, gathered, {gathered})

    def _gather_table(self, block: Block, slot: SlotInput, number: int, kept: _KeptSlots) -> None:
        """A table added to the logits by window position: its rows and columns gathered by the
        kept slots, where it meets them."""
        meeting, table = self.nodes[slot.reader], self.nodes[slot.source]
        gather = self._add_hook(
            f"windowtables{block.index}_{number}",
            WindowTableGather(block.windows.count, slot.gather_dims[-1] + 1),
        )
        with self.graph.inserting_before(meeting):
            # A table laid out by sizes read off the tokens (HF Swin reshapes its shift
            # mask to the window's token count) is built at the full window, then gathered.
            whole = copy_between(self.graph, kept.tokens, table, kept.flat) or table
            gathered = self.graph.call_module(gather, (whole, kept.positions))
        meeting.replace_input_with(table, gathered)
        if whole is not table:  # the table built at the reduced size must not run
            erase_unused(self.graph, table)


@dataclass
class _KeptSlots:
    """The reduced windows as the slot handlers read them: the windows as they came
    (``entering``, and flat), the kept tokens flat and as handed to the attention, their
    positions in each window; the full window's sizes read so far."""

    entering: fx.Node
    flat: fx.Node
    tokens: fx.Node
    handed: fx.Node
    positions: fx.Node
    shape: fx.Node | None = None
    full_sizes: dict[int, fx.Node] = field(default_factory=dict)


# What the rewrite does with each kind of slot input, in the order it does it: the size reads
# first (nothing after may read the reduced sizes where the full are meant), the tables last
# (one may meet the core itself, MaxViT's SDPA mask, which the attention's hook then replaces).
_SLOT_HANDLERS: dict[SlotKind, Callable[..., None]] = {
    SlotKind.FULL_SIZE_READ: WindowRewrites._read_full_window,
    SlotKind.QUERY_TERM: WindowRewrites._query_term_at_full_window,
    SlotKind.QUERY_ROWS: WindowRewrites._gather_query_rows,
    SlotKind.TABLE: WindowRewrites._gather_table,
}


def group_tokens(windows: Windows, slots: tuple[int, ...]) -> int:
    """How many tokens each window of a group holds (all hold as many)."""
    return sum(1 for slot in slots if slot // windows.tokens == slots[0] // windows.tokens)
