"""The words a method's parts share: where a reducer sits in a block, how it counts the tokens it
keeps, and what the located block's attention hands it."""

# Where a variant's reducer sits in a block.
BEFORE_BLOCK = "before_block"  # on the stream entering the block: the whole block sees fewer tokens
AFTER_ATTENTION = "after_attention"  # after the attention residual add: only the MLP sees fewer
PLACEMENTS = (BEFORE_BLOCK, AFTER_ATTENTION)

# How a variant counts the tokens it keeps at a location.
COUNT_OF_INITIAL = "initial"  # int(N0 * cumulative keep), fixed in the plan (DynamicViT, dTPS)
COUNT_OF_PRESENT = "present"  # ceil(rho * n) of the n tokens present, at run time (EViT, eTPS)
COUNT_MERGED = "merged"  # a fixed number r merged per block, counts fixed in the plan (ToMe)
KEEP_COUNTS = (COUNT_OF_INITIAL, COUNT_OF_PRESENT, COUNT_MERGED)

# What the hooked attention of a located block hands the reducer ("score" slot).
ATTENTION_GIVES_NOTHING = "nothing"
ATTENTION_GIVES_SCORE = "score"  # a per-token score (cls row, or attention received)
ATTENTION_GIVES_KEYS = "keys"  # the keys averaged over heads, (B, N, D) (ToMe's metric)
