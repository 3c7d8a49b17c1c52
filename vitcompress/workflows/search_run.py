"""``vitcompress search`` as one workflow: check the budget and the timing options, build the
fused kernels if asked, load the base and its calibration images, and search
(:func:`vitcompress.search.driver.search`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vitcompress.artifacts.artifact import file_sha256
from vitcompress.compilation.metadata import compression_info
from vitcompress.measure.models import TimingOptions
from vitcompress.search.driver import Budget, SearchConfig, SearchError, SearchResult, search
from vitcompress.workflows.inputs import DataRequest, ModelRequest


@dataclass(frozen=True)
class SearchSpace:
    """What is searched: the variants (``named``: the user listed them, so the ones left out
    are warned about), the keep ratios tried (``None``: the default), and how many candidates
    are scored at most."""

    variants: Sequence[str]
    keep_grid: Sequence[float] | None
    max_candidates: int = 24
    named: bool = False
    kept_multiple: int | None = None  # every candidate's counts rounded (--kept-multiple)


@dataclass(frozen=True)
class Calibration:
    """How the candidates are scored: images, batch size, predictor warm-up steps, seed."""

    images: int = 512
    batch_size: int = 32
    warmup_steps: int = 200
    seed: int = 0


def search_model(
    request: ModelRequest,
    data: DataRequest,
    budget: Budget,
    space: SearchSpace,
    calibration: Calibration,
    timing: TimingOptions | None,
    out: str | Path,
) -> SearchResult:
    budget.check()  # before minutes of loading
    if timing is None and budget.min_speedup is not None:
        raise SearchError(
            "--min-speedup is measured by timing candidates, which --no-throughput turns off: "
            "drop one of them"
        )
    if timing is not None and budget.min_speedup is None and timing.given:
        many = len(timing.given) > 1
        raise SearchError(
            f"{' and '.join(timing.given)} {'set' if many else 'sets'} how --min-speedup is "
            f"timed; without --min-speedup nothing is timed: add it or drop {'them' if many else 'it'}"
        )
    if timing is not None and timing.fused_kernels:
        from vitcompress.kernels import build_fused_kernels

        build_fused_kernels()  # before minutes of scoring, not after them
    loaded = request.load()
    if compression_info(loaded.model) is not None:
        raise SearchError(f"{request.spec} is already compressed; search its base model instead")
    dataset, config = data.for_model(loaded.model, loaded.input_size)
    search_config = SearchConfig(
        budget=budget,
        variants=space.variants,
        out=Path(out),
        calib_images=calibration.images,
        batch_size=calibration.batch_size,
        keep_grid=space.keep_grid,
        max_candidates=space.max_candidates,
        warmup_steps=calibration.warmup_steps,
        seed=calibration.seed,
        timing=timing,
        variants_named=space.named,
        kept_multiple=space.kept_multiple,
        identity={
            "model": request.spec,
            "model_args": list(request.typed_args),
            "checkpoint": request.checkpoint,
            "pretrained": request.pretrained,
            "data": data.source,
            "split": data.split,
            "data_config": config.to_json(),
            # The weights by their content, not only their path (a checkpoint written again
            # in place is another model); both only where given, so that an older cache of a
            # search without them still matches.
            **(
                {"checkpoint_sha256": file_sha256(request.checkpoint)} if request.checkpoint else {}
            ),
            **({"data_dir": str(Path(data.data_dir).resolve())} if data.data_dir else {}),
        },
    )
    return search(loaded, dataset, search_config)
