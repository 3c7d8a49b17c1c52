"""Merge the JSON outputs of ``apply``, ``bench``, ``eval`` and ``finetune`` into one comparison.

Each file becomes one or two rows (a base and a compressed model where the file holds both). Rows
are joined on the identity of their model (:mod:`vitcompress.workflows.identity`): the same
artifact content under any path, or the same timm name, file or module with the same arguments,
weights and input size. Equal cost never joins two rows: two models can share params and MACs. A
result without an identity (from an older version, or a compressed model that was not saved)
stays a row of its own. A field already filled is kept (files are read in the order given), so the
first measurement of a throughput wins; two results of one model that disagree on top-1 (another
data set) stay two rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitcompress.errors import UserError
from vitcompress.loading import ARTIFACT_MARKER
from vitcompress.workflows.identity import artifact_identity, identity_key

__all__ = [
    "ReportError",
    "ReportRow",
    "load_rows",
    "merge_rows",
    "read_report_file",
    "render_markdown",
    "render_png",
    "rows_to_json",
]

MARKDOWN_COLUMNS = (
    "name",
    "variant",
    "keep",
    "params (M)",
    "GMACs",
    "throughput (img/s)",
    "top-1 (%)",
)


class ReportError(ValueError, UserError):
    """A report input that cannot be read or recognised; one line for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).splitlines()))


@dataclass
class ReportRow:
    name: str
    variant: str | None = None
    keep: str | None = None
    params: int | None = None
    macs: int | None = None
    throughput: float | None = None
    top1: float | None = None
    top5: float | None = None
    sources: list[str] = field(default_factory=list)
    paths: set[str] = field(default_factory=set)
    identity: dict[str, Any] | None = None  # what the model is; None: joins with nothing

    @property
    def key(self) -> str | None:
        return identity_key(self.identity)

    @property
    def gmacs(self) -> float | None:
        return None if self.macs is None else self.macs / 1e9

    @property
    def label(self) -> str:
        if self.variant in (None, "none"):
            return "base"
        return f"{self.variant} {self.keep}" if self.keep else str(self.variant)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "variant": self.variant,
            "keep": self.keep,
            "params": self.params,
            "macs": self.macs,
            "gmacs": self.gmacs,
            "throughput": self.throughput,
            "top1": self.top1,
            "top5": self.top5,
            "identity": self.identity,
            "sources": list(self.sources),
            "paths": sorted(self.paths),
        }


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def read_report_file(path: str | Path) -> list[ReportRow]:
    """The rows one JSON file contributes; :class:`ReportError` if it is unreadable or unknown."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path} is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        rows = _classify(data, path)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ReportError):
            raise
        raise ReportError(f"{path}: malformed {_kind_hint(data)} output ({e!r})") from e
    if rows is None:
        raise ReportError(
            f"{path}: not the JSON of apply, bench, eval or finetune (keys: "
            f"{', '.join(sorted(data)[:8]) or 'none'})"
        )
    for row in rows:
        row.sources.append(str(path))
    return rows


def _kind_hint(data: dict[str, Any]) -> str:
    if "finetune" in data or "history" in data:
        return "finetune"
    if "top1" in data:
        return "eval"
    if "plan" in data:
        return "apply"
    return "bench"


def _classify(data: dict[str, Any], path: Path) -> list[ReportRow] | None:
    stem = path.stem if path.name != ARTIFACT_MARKER else path.parent.name
    if "finetune" in data and isinstance(data["finetune"], dict):  # a fine-tuned artifact
        return [_artifact_row(path.parent, data.get("plan") or {}, data["finetune"], stem)]
    if "history" in data and "val_top1" in data:  # finetune --json
        return [_artifact_row(_path_or_none(data.get("out"), path), data, data, stem)]
    if "plan" in data and "source" in data:  # a compressed artifact's vitcompress.json
        return [_artifact_row(path.parent, data["plan"], None, stem)]
    if "top1" in data:  # eval --json
        return _eval_rows(data, path, stem)
    if "plan" in data and "base" in data and "compressed" in data:  # apply --json
        return _apply_rows(data, path, stem)
    if "params" in data and "macs" in data:  # bench --json
        return [_measured(_named_row(data.get("identity"), data.get("model"), stem), data)]
    return None


def _named_row(identity: Any, spec: Any, fallback: str, **fields: Any) -> ReportRow:
    """A row for the model ``identity`` names (``spec``, the --model as typed, when there is
    none), called after what it is, else after ``fallback`` (its file)."""
    identity = identity if isinstance(identity, dict) else None
    row = ReportRow(
        name=_identity_name(identity) or _short_spec(spec) or fallback, identity=identity, **fields
    )
    if identity and identity.get("path"):
        row.paths.add(str(identity["path"]))
    return row


def _identity_name(identity: dict[str, Any] | None) -> str | None:
    if not identity:
        return None
    if identity.get("kind") == "artifact" and identity.get("path"):
        return Path(str(identity["path"])).name
    if identity.get("kind") == "unsaved" and isinstance(identity.get("base"), dict):
        base = _identity_name(identity["base"])
        return f"{base} (compressed, not saved)" if base else None
    return _short_spec(identity.get("source") or identity.get("spec"))


def _apply_rows(data: dict[str, Any], path: Path, stem: str) -> list[ReportRow]:
    plan = data["plan"]
    base = _measured(
        _named_row(data["base"].get("identity"), None, f"{stem} (base)", variant="none"),
        data["base"],
    )
    keep = _plan_keep_text(plan)
    identity = data["compressed"].get("identity")
    out = _path_or_none(data.get("out"), path)
    if identity is None and out is not None:  # written before results named their model
        identity = artifact_identity(out)
    compressed = _named_row(
        identity, None, out.name if out else stem, variant=str(plan["variant"]), keep=keep
    )
    return [base, _measured(compressed, data["compressed"])]


def _eval_rows(data: dict[str, Any], path: Path, stem: str) -> list[ReportRow]:
    model = _named_row(
        data.get("identity") or _spec_identity(data.get("model"), path), data.get("model"), stem
    )
    _read_plan(model)
    if isinstance(data.get("compressed"), dict) and isinstance(data.get("base"), dict):
        base_data = data["base"]
        base = _named_row(
            base_data.get("identity") or _spec_identity(base_data.get("spec"), path),
            base_data.get("spec"),
            f"{stem} (base)",
            variant="none",
        )
        base.top1, base.top5 = _number(base_data["top1"]), _number(base_data.get("top5"))
        _measured(base, base_data)
        _measured(model, data["compressed"])
        model.top1, model.top5 = _number(data["top1"]), _number(data.get("top5"))
        return [base, model]
    model.top1, model.top5 = _number(data["top1"]), _number(data.get("top5"))
    return [model]


def _artifact_row(
    directory: Path | None, plan: dict[str, Any], summary: dict[str, Any] | None, stem: str
) -> ReportRow:
    """An artifact named by its folder: its own ``vitcompress.json``, or a fine-tuning summary
    (``val_top1``, a fraction) of the model written there."""
    identity = artifact_identity(directory) if directory is not None else None
    top1 = summary.get("val_top1") if summary else None
    row = _named_row(
        identity,
        None,
        directory.name if directory else stem,
        variant=str(plan["variant"]) if plan.get("variant") else None,
        keep=_plan_keep_text(plan),
        # fine-tuning records a fraction; eval and the table use percent
        top1=None if top1 is None else 100.0 * float(top1),
    )
    if directory is not None:
        row.paths.add(str(directory.resolve()))
    return row


def _measured(row: ReportRow, data: dict[str, Any]) -> ReportRow:
    row.params = int(data["params"])
    row.macs = int(data["macs"])
    row.throughput = _number(data.get("throughput"))
    return row


def _short_spec(spec: Any) -> str | None:
    """``path/to/file.py:factory`` -> ``file.py:factory``; a directory -> its name."""
    if not spec:
        return None
    text = str(spec).rstrip("/")
    return text.rsplit("/", 1)[-1] if "/" in text else text


def _number(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    if math.isnan(number):
        return None
    return number


def _plan_keep_text(plan: dict[str, Any]) -> str | None:
    """A plan's amount as a row shows it, in its method's words (ToMe: its r); a plan of a
    method not registered here shows its keep ratios."""
    from vitcompress.variants import VARIANTS

    method = VARIANTS.get(str(plan.get("variant")))
    if method is None:
        return _keep_text(plan.get("keep"))
    return method.amount_text(plan.get("locations") or [], plan.get("keep"))


def _keep_text(keep: Any) -> str | None:
    if keep is None:
        return None
    values = keep if isinstance(keep, list | tuple) else [keep]
    texts = [f"{float(v):g}" for v in values]
    return texts[0] if len(set(texts)) == 1 else ",".join(texts)


def _path_or_none(value: Any, source: Path) -> Path | None:
    if not value:
        return None
    candidate = Path(str(value))
    if not candidate.is_absolute() and not candidate.exists():
        beside = source.parent / candidate
        if beside.exists():
            candidate = beside
    return candidate.resolve()


def _spec_identity(spec: Any, source: Path) -> dict[str, Any] | None:
    """For results written before they named their model: a --model that is an artifact
    directory (tried as written, then beside the JSON file), hashed now."""
    directory = _path_or_none(spec, source)
    if directory is None or not (directory / ARTIFACT_MARKER).is_file():
        return None
    return artifact_identity(directory)


def _read_plan(row: ReportRow) -> None:
    """Variant and keep of an artifact row, from its directory's plan."""
    if not row.identity or row.identity.get("kind") != "artifact":
        return
    try:
        marker = Path(str(row.identity["path"])) / ARTIFACT_MARKER
        plan = json.loads(marker.read_text()).get("plan") or {}
    except (OSError, ValueError, AttributeError):
        return
    if plan.get("variant"):
        row.variant = str(plan["variant"])
        row.keep = _plan_keep_text(plan)


# --------------------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------------------

_FILLED = ("variant", "keep", "params", "macs", "throughput", "top1", "top5")


def _same_model(a: ReportRow, b: ReportRow) -> bool:
    if a.key is None or a.key != b.key:
        return False
    # One model; still two rows when the results disagree on what they measured (top-1 on
    # another data set, or a plan read from a folder that has since been written again).
    return all(
        getattr(a, key) is None or getattr(b, key) is None or getattr(a, key) == getattr(b, key)
        for key in ("variant", "keep", "top1")
    )


def _absorb(into: ReportRow, other: ReportRow) -> None:
    for key in _FILLED:
        if getattr(into, key) is None and getattr(other, key) is not None:
            setattr(into, key, getattr(other, key))
    into.paths |= other.paths
    into.sources.extend(s for s in other.sources if s not in into.sources)


def merge_rows(rows: Iterable[ReportRow]) -> list[ReportRow]:
    """Rows of one model joined into one; every row's name unique afterwards."""
    merged: list[ReportRow] = []
    for row in rows:
        for existing in merged:
            if _same_model(existing, row):
                _absorb(existing, row)
                break
        else:
            merged.append(row)
    _make_names_unique(merged)
    return merged


def _make_names_unique(rows: list[ReportRow]) -> None:
    """Rows of different models that would print the same name: artifacts gain the folders above
    them until they differ; anything else gains a short hash of what it is."""
    by_name: dict[str, list[ReportRow]] = {}
    for row in rows:
        by_name.setdefault(row.name, []).append(row)
    taken = {row.name for row in rows}
    for name, clash in by_name.items():
        if len(clash) < 2:
            continue
        for i, row in enumerate(clash):
            new = _path_name(row, clash) or f"{name} #{(row.key or str(i + 1))[:6]}"
            while new in taken:
                new = f"{new}'"
            taken.add(new)
            row.name = new


def _path_name(row: ReportRow, clash: list[ReportRow]) -> str | None:
    """The shortest trailing part of the row's artifact path that the other rows do not share."""

    def parts(r: ReportRow) -> tuple[str, ...] | None:
        if not r.identity or r.identity.get("kind") != "artifact" or not r.identity.get("path"):
            return None
        return Path(str(r.identity["path"])).parts

    mine = parts(row)
    others = [parts(r) for r in clash if r is not row]
    if mine is None or any(p is None or p == mine for p in others):
        return None
    for depth in range(2, len(mine) + 1):
        tail = mine[-depth:]
        if all(p[-depth:] != tail for p in others if p is not None):
            return "/".join(tail).lstrip("/")
    return None


def load_rows(paths: Sequence[str | Path]) -> list[ReportRow]:
    rows: list[ReportRow] = []
    for path in paths:
        rows.extend(read_report_file(path))
    return merge_rows(rows)


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def row_cells(row: ReportRow) -> list[str]:
    """The table's text for one row, in :data:`MARKDOWN_COLUMNS` order."""
    return [
        row.name,
        row.variant or "-",
        row.keep or ("1" if row.variant == "none" else "-"),
        "-" if row.params is None else f"{row.params / 1e6:.4f}",
        "-" if row.gmacs is None else f"{row.gmacs:.4f}",
        "-" if row.throughput is None else f"{row.throughput:.1f}",
        "-" if row.top1 is None else f"{row.top1:.2f}",
    ]


def render_markdown(rows: Sequence[ReportRow]) -> str:
    def escape(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(MARKDOWN_COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(escape(c) for c in row_cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def rows_to_json(rows: Sequence[ReportRow]) -> dict[str, Any]:
    return {"rows": [row.to_json() for row in rows]}


def import_pyplot() -> Any:
    """matplotlib's pyplot on a file-only backend; :class:`ReportError` if it is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise ReportError("plots need matplotlib: pip install 'vitcompress[plots]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render_png(rows: Sequence[ReportRow], out: str | Path) -> Path:
    """Two panels: top-1 vs GMACs and throughput vs GMACs, each point labelled with its row's
    (unique) name and its variant and keep."""
    plt = import_pyplot()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    panels = (
        (axes[0], "top1", "top-1 (%)", "accuracy vs GMACs"),
        (axes[1], "throughput", "throughput (img/s)", "throughput vs GMACs"),
    )
    for ax, key, ylabel, title in panels:
        points = [
            (row.gmacs, getattr(row, key), row)
            for row in rows
            if row.gmacs is not None and getattr(row, key) is not None
        ]
        for x, y, row in points:
            base = row.variant in (None, "none")
            ax.scatter(
                [x],
                [y],
                marker="s" if base else "o",
                s=48,
                color="0.3" if base else f"C{_variant_colour(row.variant)}",
                zorder=3,
            )
            ax.annotate(
                point_label(row), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8
            )
        if not points:
            ax.text(
                0.5,
                0.5,
                f"no rows with GMACs and {ylabel}",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="0.4",
            )
        ax.margins(x=0.15, y=0.15)  # room for the labels of the outermost points
        ax.set_xlabel("GMACs")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def point_label(row: ReportRow) -> str:
    """``name (dtps 0.7)``: unique, because row names are (:func:`merge_rows`)."""
    return f"{row.name} ({row.label})"


def _variant_colour(variant: str | None) -> int:
    """The variant's colour slot: the registry's report order, then any other (one slot)."""
    from vitcompress.variants import VARIANTS

    order = sorted(VARIANTS, key=lambda name: (VARIANTS[name].report_order, name))
    return order.index(variant) if variant in order else len(order)
