"""Merge the JSON outputs of ``apply``, ``bench``, ``eval`` and ``finetune`` into one comparison.

Each file becomes one or two rows (a base and a compressed model where the file holds both). Rows
that describe the same model are merged: the same artifact path, or the same params and MACs with
no disagreement on variant, keep or top-1. A field already filled is kept (files are read in the
order given), so the first measurement of a throughput wins.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vitcompress.loading import ARTIFACT_MARKER

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

MARKDOWN_COLUMNS = ("name", "variant", "keep", "params (M)", "GMACs", "throughput (img/s)",
                    "top-1 (%)")


class ReportError(ValueError):
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
    fallback_name: bool = False  # named after its file, for want of a model spec or path

    @property
    def gmacs(self) -> float | None:
        return None if self.macs is None else self.macs / 1e9

    @property
    def label(self) -> str:
        if self.variant in (None, "none"):
            return "base"
        return f"{self.variant} {self.keep}" if self.keep else str(self.variant)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["paths"] = sorted(self.paths)
        data.pop("fallback_name")
        data["gmacs"] = self.gmacs
        return data


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
        raise ReportError(f"{path}: not the JSON of apply, bench, eval or finetune (keys: "
                          f"{', '.join(sorted(data)[:8]) or 'none'})")
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
        return [_finetune_row(data["finetune"], data.get("plan") or {}, path.parent, stem)]
    if "history" in data and "val_top1" in data:  # finetune --json
        return [_finetune_row(data, data, _path_or_none(data.get("out"), path), stem)]
    if "plan" in data and "source" in data:  # a compressed artifact's vitcompress.json
        plan = data["plan"]
        row = ReportRow(name=stem, variant=str(plan["variant"]), keep=_keep_text(plan.get("keep")))
        row.paths.add(str(path.parent.resolve()))
        return [row]
    if "top1" in data:  # eval --json
        return _eval_rows(data, path, stem)
    if "plan" in data and "base" in data and "compressed" in data:  # apply --json
        return _apply_rows(data, path, stem)
    if "params" in data and "macs" in data:  # bench --json
        return [_measured(ReportRow(name=stem, fallback_name=True), data)]
    return None


def _apply_rows(data: dict[str, Any], path: Path, stem: str) -> list[ReportRow]:
    plan = data["plan"]
    base = _measured(ReportRow(name=f"{stem} (base)", variant="none", fallback_name=True),
                     data["base"])
    out = _path_or_none(data.get("out"), path)
    compressed = ReportRow(name=out.name if out else stem, variant=str(plan["variant"]),
                           keep=_keep_text(plan.get("keep")), fallback_name=out is None)
    if out:
        compressed.paths.add(str(out))
    return [base, _measured(compressed, data["compressed"])]


def _eval_rows(data: dict[str, Any], path: Path, stem: str) -> list[ReportRow]:
    model = ReportRow(name=_short_spec(data.get("model")) or stem,
                      fallback_name=not data.get("model"))
    _add_spec(model, data.get("model"), path)
    if isinstance(data.get("compressed"), dict) and isinstance(data.get("base"), dict):
        base_data = data["base"]
        base = ReportRow(name=_short_spec(base_data.get("spec")) or f"{stem} (base)",
                         variant="none", fallback_name=not base_data.get("spec"))
        _add_spec(base, base_data.get("spec"), path)
        base.top1, base.top5 = _number(base_data["top1"]), _number(base_data.get("top5"))
        _measured(base, base_data)
        _measured(model, data["compressed"])
        model.top1, model.top5 = _number(data["top1"]), _number(data.get("top5"))
        return [base, model]
    model.top1, model.top5 = _number(data["top1"]), _number(data.get("top5"))
    return [model]


def _finetune_row(summary: dict[str, Any], plan: dict[str, Any], out: Path | None,
                  stem: str) -> ReportRow:
    top1 = summary.get("val_top1")
    row = ReportRow(name=out.name if out else stem, fallback_name=out is None,
                    variant=str(plan["variant"]) if plan.get("variant") else None,
                    keep=_keep_text(plan.get("keep")),
                    # fine-tuning records a fraction; eval and the table use percent
                    top1=None if top1 is None else 100.0 * float(top1))
    if out:
        row.paths.add(str(out))
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


def _add_spec(row: ReportRow, spec: Any, source: Path) -> None:
    """A --model spec that is an artifact: remember its path and read its plan."""
    if not spec:
        return
    directory = _path_or_none(spec, source)
    if directory is None or not (directory / ARTIFACT_MARKER).is_file():
        return
    row.paths.add(str(directory))
    row.name = directory.name
    try:
        plan = json.loads((directory / ARTIFACT_MARKER).read_text()).get("plan") or {}
    except (OSError, ValueError):
        return
    if plan.get("variant"):
        row.variant = str(plan["variant"])
        row.keep = _keep_text(plan.get("keep"))


# --------------------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------------------

_FILLED = ("variant", "keep", "params", "macs", "throughput", "top1", "top5")


def _same_model(a: ReportRow, b: ReportRow) -> bool:
    if a.paths & b.paths:
        return True
    if a.params is None or a.macs is None or (a.params, a.macs) != (b.params, b.macs):
        return False
    # Equal cost; still different models if they disagree on what they are or how they score
    # (a compressed model before and after fine-tuning).
    return all(getattr(a, key) is None or getattr(b, key) is None
               or getattr(a, key) == getattr(b, key) for key in ("variant", "keep", "top1"))


def _absorb(into: ReportRow, other: ReportRow) -> None:
    for key in _FILLED:
        if getattr(into, key) is None and getattr(other, key) is not None:
            setattr(into, key, getattr(other, key))
    # A name taken from a path or spec is more telling than one taken from a file name.
    if (other.paths and not into.paths) or (into.fallback_name and not other.fallback_name):
        into.name, into.fallback_name = other.name, other.fallback_name
    into.paths |= other.paths
    into.sources.extend(s for s in other.sources if s not in into.sources)


def merge_rows(rows: Iterable[ReportRow]) -> list[ReportRow]:
    merged: list[ReportRow] = []
    for row in rows:
        for existing in merged:
            if _same_model(existing, row):
                _absorb(existing, row)
                break
        else:
            merged.append(row)
    return merged


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

    lines = ["| " + " | ".join(MARKDOWN_COLUMNS) + " |",
             "|" + "|".join("---" if i < 3 else "---:" for i in range(len(MARKDOWN_COLUMNS)))
             + "|"]
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
    """Two panels: top-1 vs GMACs and throughput vs GMACs, points labelled by variant and keep."""
    plt = import_pyplot()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    panels = ((axes[0], "top1", "top-1 (%)", "accuracy vs GMACs"),
              (axes[1], "throughput", "throughput (img/s)", "throughput vs GMACs"))
    for ax, key, ylabel, title in panels:
        points = [(row.gmacs, getattr(row, key), row) for row in rows
                  if row.gmacs is not None and getattr(row, key) is not None]
        for x, y, row in points:
            base = row.variant in (None, "none")
            ax.scatter([x], [y], marker="s" if base else "o", s=48,
                       color="0.3" if base else f"C{_variant_colour(row.variant)}", zorder=3)
            ax.annotate(row.label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        if not points:
            ax.text(0.5, 0.5, f"no rows with GMACs and {ylabel}", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
        ax.margins(x=0.15, y=0.15)  # room for the labels of the outermost points
        ax.set_xlabel("GMACs")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _variant_colour(variant: str | None) -> int:
    order = ("dtps", "etps", "dynamicvit", "evit")
    return order.index(variant) if variant in order else 4
