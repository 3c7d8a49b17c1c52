"""Which tokens a compressed model keeps, and where TPS squeezes the pruned ones.

One image goes through the model's inference path once. A forward hook on every reducer
(``model.tps.<i>``) reads the grid positions present before and after its location. For the TPS
variants the host of every pruned token is recomputed from the reducer's input tokens with the same
functions the reducer uses (cosine similarity of the raw features, argmax over the kept tokens), so
the picture is the matching the model made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitcompress.compilation.metadata import CompressionInfo, compression_info
from vitcompress.compilation.plan import Location
from vitcompress.compilation.rewrite import REDUCER_PREFIX
from vitcompress.data.config import DataConfig
from vitcompress.variants import BEFORE_BLOCK, VARIANTS, Fuse, Variant
from vitcompress.workflows.report import ReportError, import_pyplot

__all__ = [
    "LocationRecord",
    "VisualizeError",
    "draw_locations",
    "load_image",
    "record_locations",
]


class VisualizeError(ReportError):
    """An image or model the visualisation cannot use; one line for the user."""


@dataclass
class LocationRecord:
    """What happened at one location, for the first image of the batch."""

    index: int
    block: int
    stage: int
    grid: tuple[int, int]
    variant: str
    present: list[int]  # grid positions entering the location
    kept: list[int]  # grid positions leaving it (EViT's fused token left out)
    pruned: list[int]
    fused_token: bool = False  # EViT: an extra token off the grid after this location
    # TPS: host -> its donors; ToMe: a merged token's position -> every position merged into it
    # so far (its group, this location's merges and earlier ones)
    hosts: dict[int, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "block": self.block,
            "stage": self.stage,
            "grid": list(self.grid),
            "variant": self.variant,
            "present": self.present,
            "kept": self.kept,
            "pruned": self.pruned,
            "fused_token": self.fused_token,
            "hosts": {str(k): v for k, v in self.hosts.items()},
        }


# --------------------------------------------------------------------------------------------------
# Input
# --------------------------------------------------------------------------------------------------


def load_image(
    path: str | Path, input_size: Sequence[int], data_config: DataConfig | None = None
) -> tuple[Any, Tensor]:
    """The image resized whole to the model's input (PIL, for drawing; no crop, so every token
    drawn covers what the picture shows) and as a (1, C, H, W) tensor normalised with the model's
    data config as ``eval`` resolves it (``None``: the defaults, ImageNet's mean/std, bicubic)."""
    from PIL import Image, UnidentifiedImageError

    channels, height, width = (int(v) for v in input_size)
    try:
        with Image.open(path) as opened:
            opened.load()
            image = opened.convert("RGB")
    except FileNotFoundError as e:
        raise VisualizeError(f"cannot read image {path}: no such file") from e
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise VisualizeError(f"cannot read image {path}: {e}") from e
    config = (data_config or DataConfig()).for_channels(channels) if channels in (1, 3) else None
    resample = Image.Resampling[(config.interpolation if config else "bicubic").upper()]
    image = image.resize((width, height), resample)
    model_image = image if channels == 3 else image.convert("L")
    if channels not in (1, 3):
        raise VisualizeError(
            f"the model takes {channels} channels; only 1 and 3 can be read from an image"
        )
    pixels = torch.frombuffer(bytearray(model_image.tobytes()), dtype=torch.uint8)
    tensor = pixels.reshape(height, width, channels).permute(2, 0, 1).float() / 255.0
    mean, std = torch.tensor(config.mean), torch.tensor(config.std)
    tensor = (tensor - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    return image, tensor.unsqueeze(0)


# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------


def _reducers(model: nn.Module, info: CompressionInfo | None) -> list[nn.Module]:
    tps = getattr(model, REDUCER_PREFIX, None)
    if info is None or tps is None:
        raise VisualizeError(
            "the model is not compressed (no TPS plan); compress it with "
            "`vitcompress apply --out DIR` and pass that directory"
        )
    reducers = [tps.get_submodule(str(i)) for i in range(len(info.plan.locations))]
    for r in reducers:
        # What a variant's reducer must have for the hooks below (Variant.build_reducer).
        if not isinstance(getattr(r, "prefix_tokens", None), int):
            raise VisualizeError(f"unknown reducer {type(r).__name__} in model.{REDUCER_PREFIX}")
    return reducers


def _location_grid(info: CompressionInfo, location: Location) -> tuple[int, ...]:
    """The patch grid of the location's stage (a pyramid's later stages have smaller ones)."""
    return info.model_map.stages[location.stage].grid


def _input_positions(method: Variant, args: tuple, kwargs: dict) -> Tensor | None:
    """``positions`` is the reducer's 3rd argument before a block, its 4th after the attention
    (which gives it a score or keys first)."""
    slot = 2 if method.placement == BEFORE_BLOCK else 3
    return kwargs.get("positions", args[slot] if len(args) > slot else None)


@torch.no_grad()
def record_locations(model: nn.Module, image: Tensor) -> tuple[list[LocationRecord], Tensor]:
    """Run ``image`` (1, C, H, W) through the model in eval mode; one record per location, and
    the logits. The model's mode is restored afterwards."""
    info = compression_info(model)
    reducers = _reducers(model, info)
    assert info is not None  # _reducers refused an uncompressed model
    flat = [s.grid for s in info.model_map.stages if len(s.grid) != 2]
    if flat:
        raise VisualizeError(
            f"visualize draws 2-D token grids on an image; this model's grid is "
            f"{'x'.join(map(str, flat[0]))} ({len(flat[0])}-D, a video's T x H x W)"
        )
    records: list[LocationRecord] = []
    failures: list[BaseException] = []
    groups: dict[int, list[int]] = {}  # ToMe: merged so far, by the position merged into

    def make_hook(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            try:
                records.append(_location_record(info, i, module, args, kwargs, output, groups))
            except Exception as e:  # noqa: BLE001 - re-raised after the forward pass
                failures.append(e)

        return hook

    handles = [
        r.register_forward_hook(make_hook(i), with_kwargs=True) for i, r in enumerate(reducers)
    ]
    was_training = model.training
    for reducer in reducers:
        reducer.record, reducer.assignment = True, None
    try:
        model.eval()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        logits = model(image.to(device))
    finally:
        for handle in handles:
            handle.remove()
        for reducer in reducers:
            reducer.record, reducer.assignment = False, None
        model.train(was_training)
    if failures:
        raise failures[0]
    return _one_per_location(records, len(reducers)), logits


def _location_record(
    info: CompressionInfo,
    i: int,
    reducer: nn.Module,
    args: tuple,
    kwargs: dict,
    output: Any,
    groups: dict[int, list[int]],
) -> LocationRecord:
    """What location ``i``'s reducer did on one call (``args``, ``kwargs`` -> ``output``):
    the grid positions present, kept and pruned, and the hosts of the kept ones where its
    method's fuse explains its assignment (``groups``: merged so far, updated)."""
    method = info.plan.method
    location = info.plan.locations[i]
    x = args[0] if args else kwargs["x"]
    n = x.shape[1] - reducer.prefix_tokens
    given = _input_positions(method, args, kwargs)
    present = list(range(n)) if given is None else given[0].tolist()
    after = output[2]
    out_positions = list(range(n)) if after is None else after[0].tolist()
    kept = [p for p in out_positions if p >= 0]
    kept_set = set(kept)
    record = LocationRecord(
        index=i,
        block=location.block,
        stage=location.stage,
        grid=_location_grid(info, location),
        variant=info.plan.variant,
        present=[p for p in present if p >= 0],
        kept=kept,
        pruned=[p for p in present if p >= 0 and p not in kept_set],
        # A fuse that adds a token does so whenever it prunes (the reducer returns x unchanged
        # when there is nothing to prune)
        fused_token=method.fuse.adds_token and output[0] is not x,
    )
    # What the reducer recorded of its own assignment, as its method explains it.
    assignment = reducer.assignment
    if assignment is not None:
        hosts = method.fuse.explain(assignment, present, groups)
        if hosts is not None:
            record.hosts = {pos: hosts[pos] for pos in kept if pos in hosts}
    return record


def _one_per_location(records: list[LocationRecord], locations: int) -> list[LocationRecord]:
    """``records`` in location order, refused unless each of the ``locations`` ran once."""
    records.sort(key=lambda r: r.index)
    repeated = [r.block for r in records if sum(o.index == r.index for o in records) > 1]
    if repeated:  # padded windows, reduced group by group (docs/windowed.md)
        raise VisualizeError(
            f"block {repeated[0]} reduces its windows in groups of different sizes (its grid "
            "does not divide into its windows); visualize draws one reduction per location"
        )
    if len(records) != locations:
        raise VisualizeError(f"only {len(records)} of {locations} locations ran")
    return records


# --------------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------------


def _cell_boxes(
    grid: tuple[int, int], size: tuple[int, int]
) -> Callable[[int], tuple[float, float, float, float]]:
    """Pixel box (x0, y0, w, h) of each grid position on an image of (width, height)."""
    gh, gw = grid
    width, height = size
    ch, cw = height / gh, width / gw
    # imshow puts pixel centres on integers: the image spans -0.5 .. size - 0.5
    return lambda pos: ((pos % gw) * cw - 0.5, (pos // gw) * ch - 0.5, cw, ch)


# Cells blanked in a panel: tokens pruned at an earlier location are gone (opaque); tokens pruned
# at this location (DynamicViT, EViT) still show a trace of the image.
_GONE = {"facecolor": "white", "edgecolor": "0.6", "alpha": 1.0}
_PRUNED_HERE = {"facecolor": "white", "edgecolor": "0.6", "alpha": 0.92}


def _fuse(record: LocationRecord) -> Fuse:
    """The fuse of the record's method (a method no longer registered: a plain drop)."""
    method = VARIANTS.get(record.variant)
    return method.fuse if method is not None else Fuse()


def legend_entries(
    records: Sequence[LocationRecord], colour: Any = "tab:blue"
) -> list[tuple[str, dict[str, Any]]]:
    """(label, patch style) for each kind of cell the panels of ``records`` show, in the words
    of the method's fuse."""
    taken = [record for record in records if record.hosts]
    entries: list[tuple[str, dict[str, Any]]] = []
    if taken:
        host, donor, untouched = _fuse(taken[0]).legend
        entries += [
            (host, {"facecolor": colour, "edgecolor": "black", "alpha": 0.8}),
            (donor, {"facecolor": colour, "edgecolor": "none", "alpha": 0.55}),
            (untouched, {"facecolor": "0.55", "edgecolor": "none", "alpha": 1.0}),
        ]
    else:
        entries += [
            ("kept (image shown)", {"facecolor": "none", "edgecolor": "0.6", "alpha": 1.0}),
            ("pruned at this location (faint)", _PRUNED_HERE),
        ]
    if any(record.present != list(range(record.grid[0] * record.grid[1])) for record in records):
        entries.append(("pruned at an earlier location (blank)", _GONE))
    added = [record for record in records if record.fused_token]
    if added:
        entries.append(
            (
                _fuse(added[0]).added_token_legend,
                {"facecolor": "none", "edgecolor": "none", "alpha": 1.0},
            )
        )
    return entries


def _legend_handle(style: dict[str, Any]) -> Any:
    from matplotlib.patches import Patch

    return Patch(**style)


def draw_locations(
    image: Any, records: Sequence[LocationRecord], out: str | Path, title: str | None = None
) -> Path:
    """The input image, then one panel per location: pruned cells blanked (DynamicViT/EViT), or
    each host and its donors in one colour (TPS; hosts outlined)."""
    plt = import_pyplot()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = len(records) + 1
    fig, axes = plt.subplots(
        1, panels, figsize=(3.2 * panels, 3.6), squeeze=False, constrained_layout=True
    )
    axes = axes[0]
    axes[0].imshow(image)
    axes[0].set_title("input")
    palette = plt.get_cmap("tab20").colors
    # TPS panels on a grey copy so the group colours read clearly.
    grey = image.convert("L")
    for ax, record in zip(axes[1:], records, strict=True):
        _draw_panel(ax, record, image, grey, palette)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    entries = legend_entries(records, palette[0])
    fig.legend(
        handles=[_legend_handle(style) for _, style in entries],
        labels=[label for label, _ in entries],
        loc="outside lower center",
        ncol=min(len(entries), 3),
        fontsize=8,
        frameon=False,
    )
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _draw_panel(ax: Any, record: LocationRecord, image: Any, grey: Any, palette: Any) -> None:
    """One location's panel on ``ax``: pruned cells blanked over ``image``, or each host and its
    donors in one colour of ``palette`` over ``grey``; titled with its counts."""
    from matplotlib.patches import Rectangle

    if record.hosts:
        ax.imshow(grey, cmap="gray", vmin=0, vmax=255)
    else:
        ax.imshow(image)
    box = _cell_boxes(record.grid, image.size)
    gh, gw = record.grid
    present = set(record.present)
    kept = set(record.kept)
    for pos in range(gh * gw):
        if pos not in present or (pos not in kept and not record.hosts):
            x0, y0, w, h = box(pos)
            ax.add_patch(
                Rectangle(
                    (x0, y0),
                    w,
                    h,
                    facecolor="white",
                    edgecolor="none",
                    alpha=0.92 if pos in present else 1.0,
                )
            )
    groups = [(host, donors) for host, donors in record.hosts.items() if donors]
    for k, (host, donors) in enumerate(groups):
        colour = palette[k % len(palette)]
        for pos in donors:
            x0, y0, w, h = box(pos)
            ax.add_patch(Rectangle((x0, y0), w, h, facecolor=colour, edgecolor="none", alpha=0.55))
        x0, y0, w, h = box(host)
        ax.add_patch(
            Rectangle((x0, y0), w, h, facecolor=colour, edgecolor="black", linewidth=1.0, alpha=0.8)
        )
    n0 = gh * gw
    if record.hosts and _fuse(record).groups_grow:
        what = f"{len(record.pruned)} merged here; {len(groups)} merged tokens"
    elif record.hosts:
        what = f"{len(groups)} hosts take {len(record.pruned)}"
    else:
        what = f"{len(record.pruned)} pruned"
    extra = " +1 fused" if record.fused_token else ""
    ax.set_title(
        f"block {record.block} (stage {record.stage}): {len(record.kept)}/{n0} kept{extra}\n{what}",
        fontsize=9,
    )
