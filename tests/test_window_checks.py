"""The windowed attention's checks are one ordered table: the first that finds a reason gives the
line the user sees, a check that finds none passes to the next, and each names the family that
shaped it and why it is there."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from vitcompress.analysis.cores import Ancestry
from vitcompress.analysis.model_map import AttentionCore
from vitcompress.analysis.windows import ATTENTION_CHECKS, attention_blocker
from vitcompress.analysis.windows.checks import WindowFacts

ORDER = (
    "global query",
    "padded windows",
    "windows on their own axis",
    "query term",
    "spatial sizes",
    "position tables",
    "unexplained mask",
)


def _facts(**changes) -> WindowFacts:
    """Facts under which every check up to the tables finds nothing: whole windows on their
    own axis, no query term, no table, an attention core that adds no mask to its logits."""
    core = AttentionCore(node="relu", path="blocks.0.attn", kind="sdpa", batch=8, heads=2)
    graph = fx.symbolic_trace(torch.nn.ReLU()).graph
    core_node = next(n for n in graph.nodes if n.op not in ("placeholder", "output"))
    facts = WindowFacts(
        core=core,
        core_node=core_node,
        windows_in=None,
        entering=None,
        order=torch.arange(16),
        count=4,
        window_axis=True,
        query_bias=None,
        query_blocker=None,
        tables=[],
        made=set(),
        full=set(),
        anc=Ancestry(graph),
    )
    return replace(facts, **changes)


def test_the_checks_run_in_the_order_that_decides_the_message() -> None:
    assert tuple(check.name for check in ATTENTION_CHECKS) == ORDER
    for check in ATTENTION_CHECKS:
        assert check.family and check.why


def test_the_first_reason_found_is_the_one_given() -> None:
    padded = torch.tensor([0, 1, -1, 2])
    both = _facts(query_blocker="its queries are global", order=padded)
    assert attention_blocker(both) == "its queries are global"
    only_padded = attention_blocker(_facts(order=padded))
    assert only_padded.startswith("its windows are padded")


def test_a_check_that_finds_nothing_passes_to_the_next() -> None:
    assert attention_blocker(_facts(query_bias="its query term reads rows")) == (
        "its query term reads rows"
    )
    # A query term the analysis can make at the full window is no reason.
    assert attention_blocker(_facts(query_bias=object())) is None
    assert attention_blocker(_facts()) is None
