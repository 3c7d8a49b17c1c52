"""Where a plan may reduce, and where it does by default: the blocks that attend over their own
tokens, the paper's placements and keep ratios, and the runs of windowed blocks in the same
windows (whose first block's choice the rest may carry)."""

from __future__ import annotations

import math

from vitcompress.analysis.model_map import Block, ModelMap


def reduces_tokens(block: Block) -> bool:
    """Whether a block attends over its own tokens. A class-attention block (CaiT) updates one
    class token with keys from elsewhere: it has no tokens of its own to reduce."""
    keys = block.attention.key_tokens
    return block.tokens > 1 and (keys is None or keys <= block.tokens)


def token_stages(model_map: ModelMap) -> list[list[int]]:
    """Each stage's blocks that can reduce tokens, stages without any left out."""
    stages = [
        [i for i in stage.blocks if reduces_tokens(model_map.blocks[i])]
        for stage in model_map.stages
    ]
    return [blocks for blocks in stages if blocks]


def dominant_last_stage(stages: list[list[int]]) -> bool:
    """CvT-like: several stages, but the last holds at least two thirds of the blocks."""
    return len(stages) > 1 and 3 * len(stages[-1]) >= 2 * sum(len(s) for s in stages)


def default_keep(model_map: ModelMap) -> float:
    """The paper's keep ratios: 0.5 for CvT-like models, 0.7 otherwise."""
    return 0.5 if dominant_last_stage(token_stages(model_map)) else 0.7


def default_locs(model_map: ModelMap, carry_windows: bool = False) -> list[int]:
    """The paper's placements: blocks at 1/4, 1/2 and 3/4 of the depth (3, 6, 9 of 12) for a
    single-stage ViT; for a CvT-like model three blocks of the last stage from its first, spaced
    ceil(L/4) (3, 6, 9 for CvT-13, 5, 9, 13 for CvT-21); for a pyramid (PVT) the first block of
    every stage but the first. Only blocks that attend over their own tokens count (CaiT's
    class-attention blocks do not).

    A model of windowed blocks: every windowed block, since each restores its own tokens and
    only its own reduction saves; with ``carry_windows``, the first block of every run of blocks
    in the same windows (:func:`window_runs`), the rest of the run carrying its choice. Where
    windowed stages and stages of plain blocks mix (Hiera), the first block of each plain stage
    too."""
    stages = token_stages(model_map)
    windowed = [i for blocks in stages for i in blocks if model_map.blocks[i].windows is not None]
    if windowed:
        # Each windowed block restores its own tokens: only its own reduction saves (or, with
        # carry_windows, its run's). A stage of plain blocks among them (Hiera's global stages)
        # is reduced from its first block on, as a pyramid's stages are, where its tokens can
        # get their full set back on the way out (not where the map found an exit bypass).
        plain = [
            blocks[0]
            for blocks in stages
            if blocks
            and all(model_map.blocks[i].windows is None for i in blocks)
            and model_map.stages[model_map.blocks[blocks[0]].stage].exit_bypass is None
        ]
        if carry_windows:
            windowed = [run[0] for run in window_runs(model_map, windowed)]
        return sorted(windowed + plain)
    if dominant_last_stage(stages):
        blocks = stages[-1]
        step = math.ceil(len(blocks) / 4)
        return [blocks[k * step] for k in range(3) if k * step < len(blocks)]
    if len(stages) > 1:
        return [blocks[0] for blocks in stages[1:]]
    blocks = stages[0] if stages else [0]
    depth = len(blocks)
    locs = sorted({depth * i // 4 for i in (1, 2, 3)} - {0})
    return [blocks[i] for i in locs] or blocks[:1]


def same_windows(first: Block, then: Block) -> bool:
    """Whether ``then`` attends within the windows ``first`` does, slot for slot (a shifted
    window's order differs), neither padded: a choice of slots made in one holds in the other."""
    a, b = first.windows, then.windows
    return (
        a is not None
        and b is not None
        and (a.count, a.tokens, a.order) == (b.count, b.tokens, b.order)
        and not a.padded
        # A window that holds the block's prefix (TimeSformer's one window) is not carried: a
        # replayed choice counts patch slots only.
        and a.prefix_tokens == b.prefix_tokens == 0
    )


def window_runs(model_map: ModelMap, blocks: list[int]) -> list[list[int]]:
    """``blocks`` (windowed, in order) cut into runs of consecutive ones in the same windows:
    Swin's alternating shifts give runs of one, SAM2-Hiera's global stage one run. A choice is
    of window slots, so it holds whatever runs between two blocks of a run (DaViT's channel
    attention, which is not mapped and starts a stage of the map)."""
    runs: list[list[int]] = []
    for index in blocks:
        block = model_map.blocks[index]
        if runs:
            last = model_map.blocks[runs[-1][-1]]
            if index == last.index + 1 and same_windows(last, block):
                runs[-1].append(index)
                continue
        runs.append([index])
    return runs


def describe_blocks(stages: list[list[int]]) -> str:
    """The blocks of ``stages`` for a message: ``3..9`` where they run on, else a list."""
    blocks = [i for stage in stages for i in stage]
    if blocks == list(range(blocks[0], blocks[-1] + 1)):
        return f"{blocks[0]}..{blocks[-1]}"
    return ", ".join(map(str, blocks))
