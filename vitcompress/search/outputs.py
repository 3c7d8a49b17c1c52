"""What a search writes: the recipe YAML of the chosen plan, and the plot of score against GMACs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

RECIPE_NAME = "plan.yaml"
PLOT_NAME = "pareto.png"
JSON_NAME = "search.json"


def recipe_text(best: dict[str, Any], header: Sequence[str]) -> str:
    """The plan as ``apply --plan`` / ``finetune --plan`` (and ``finetune --recipe``) read it:
    only option keys; what the search measured goes into comments."""
    import yaml

    body = {"variant": best["variant"], "locs": best["locs"], "keep": best["keep"]}
    if best.get("kept_multiple") is not None:  # apply rounds the counts as the search did
        body["variant_args"] = {"kept_multiple": best["kept_multiple"]}
    comments = "".join(f"# {line}\n" for line in header)
    return comments + yaml.safe_dump(body, default_flow_style=None, sort_keys=False)


def write_recipe(path: Path, best: dict[str, Any], header: Sequence[str]) -> Path:
    path.write_text(recipe_text(best, header))
    return path


def write_plot(
    path: Path,
    scored: Sequence[dict[str, Any]],
    front: Sequence[dict[str, Any]],
    best: dict[str, Any] | None,
    default: dict[str, Any] | None,
    budget_gmacs: float,
    base_gmacs: float,
) -> Path:
    """Score (-KL) against GMACs: every scored candidate by variant, the front as a line, the
    budget as a vertical line, the paper default and the chosen plan marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    variants = sorted({row["variant"] for row in scored})
    for variant in variants:
        rows = [r for r in scored if r["variant"] == variant and r["score"] is not None]
        axes.scatter(
            [r["gmacs"] for r in rows], [r["score"] for r in rows], s=18, alpha=0.7, label=variant
        )
    if front:
        axes.plot(
            [r["gmacs"] for r in front],
            [r["score"] for r in front],
            color="black",
            linewidth=1,
            label="Pareto front",
        )
    axes.axvline(budget_gmacs, color="grey", linestyle="--", linewidth=1, label="budget")
    axes.axvline(base_gmacs, color="grey", linestyle=":", linewidth=1, label="base")
    shown = default is not None and default.get("score") is not None
    marks = [  # (row, label, how it is drawn): the paper default, then the chosen plan over it
        (
            default if shown else None,
            f"paper default ({default['variant']} {default['locs']})" if shown else "",
            dict(marker="*", s=160, color="red", zorder=5),
        ),
        (
            best,
            "chosen",
            dict(marker="o", s=120, facecolors="none", edgecolors="green", linewidths=2, zorder=6),
        ),
    ]
    for row, label, style in marks:
        if row is not None:
            axes.scatter([row["gmacs"]], [row["score"]], label=label, **style)
    axes.set_xlabel("GMACs (batch 1)")
    axes.set_ylabel("score = -KL(base || candidate)")
    axes.legend(fontsize=7, loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
