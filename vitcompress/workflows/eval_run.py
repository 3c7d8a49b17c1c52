"""``vitcompress eval`` as one workflow: the model's accuracy on a dataset, and with a base, both
models' accuracy, cost and paired speed-up, each fed its own data config. The task decides what
accuracy is: top-1/top-5 (classification) or mean IoU and pixel accuracy (segmentation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitcompress.data import DataConfig, DataError, check_task
from vitcompress.data.config import defaults_note
from vitcompress.data.segmentation import SEGMENTATION
from vitcompress.loading import LoadedModel
from vitcompress.measure import PairedRatio
from vitcompress.measure.models import (
    Measurement,
    TimingOptions,
    measure_models,
    speedup,
)
from vitcompress.training.evaluate import (
    EvalProgress,
    evaluate,
    evaluate_segmentation,
    spread_subset,
)
from vitcompress.workflows.gates import NO_THROUGHPUT, Bounds, GateResult, check_gates, require
from vitcompress.workflows.identity import model_identity, untrained
from vitcompress.workflows.inputs import BaseRequest, DataRequest, ModelRequest

# What each task reports, headline first: the metric --max-acc-drop compares comes first.
METRICS = {"classification": ("top1", "top5"), SEGMENTATION: ("miou", "pixel_acc")}


def _config_json(config: DataConfig) -> dict[str, Any]:
    return {"data_config": config.to_json(), "data_config_sources": dict(config.sources)}


def score(
    task: str,
    model: nn.Module,
    dataset: Dataset,
    loader: dict[str, Any],
    progress: EvalProgress | None = None,
) -> dict[str, Any]:
    """The task's accuracy of ``model`` on ``dataset`` (percent): top-1/top-5, or mean IoU and
    pixel accuracy with the per-class IoU. A classifier must predict exactly the data's classes
    (one line otherwise)."""
    if task == SEGMENTATION:
        return evaluate_segmentation(model, dataset, **loader, progress=progress)
    return evaluate(model, dataset, **loader, exact_head=True, progress=progress)


def _no_progress(description: str) -> EvalProgress:
    return EvalProgress()


@dataclass
class BaseComparison:
    """The ``--base`` model: what it is, its accuracy and data config, and both models' params,
    MACs and throughput timed together (``model`` and ``base``)."""

    spec: str
    identity: dict[str, Any]
    weights: str | None
    accuracy: dict[str, Any]
    data_config: DataConfig
    measured: dict[str, Measurement]
    speedup: PairedRatio | None
    environment: dict[str, Any]


@dataclass
class EvalResult:
    spec: str
    data: str
    split: str
    input_size: tuple[int, ...]
    accuracy: dict[str, Any]  # top1, top5 or miou, pixel_acc, iou (percent), images
    data_config: DataConfig
    identity: dict[str, Any]
    base: BaseComparison | None = None
    task: str = "classification"
    gmacs: float | None = None  # of a lone model, measured for --max-gmacs only
    gates: list[GateResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # values nobody stated, for stderr

    @property
    def metrics(self) -> tuple[str, str]:
        """The two numbers the task reports (``top1``, ``top5`` or ``miou``, ``pixel_acc``)."""
        return METRICS[self.task]  # type: ignore[return-value]

    def _scores(self, accuracy: dict[str, Any]) -> dict[str, Any]:
        return {name: accuracy[name] for name in self.metrics}

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "model": self.spec,
            "data": self.data,
            "split": self.split,
            "input_size": list(self.input_size),
            "images": self.accuracy["images"],
            **({"task": self.task} if self.task != "classification" else {}),
            **self._scores(self.accuracy),
            **({"iou": self.accuracy["iou"]} if "iou" in self.accuracy else {}),
            **_config_json(self.data_config),
            "identity": self.identity,  # what report joins on
        }
        base = self.base
        if base is not None:
            result["speedup"] = None if base.speedup is None else base.speedup.to_json()
            result["base"] = {
                **self._scores(base.accuracy),
                **base.measured["base"].to_json(),
                **_config_json(base.data_config),
                "spec": base.spec,
                "identity": base.identity,
                "weights": base.weights,
            }
            result["compressed"] = {
                **self._scores(self.accuracy),
                **base.measured["model"].to_json(),
                **_config_json(self.data_config),
            }
            for name in self.metrics:
                result[f"delta_{name}"] = result[name] - result["base"][name]
            result["environment"] = base.environment
        elif self.gmacs is not None:
            result["gmacs"] = self.gmacs
        result["gates"] = [g.to_json() for g in self.gates]
        return result

    def gate_values(self) -> dict[str, float | None]:
        """What the gates compare: top-1 (segmentation: mIoU) points lost against the base, the
        paired speed-up over it, and the model's GMACs."""
        if self.base is None:
            return {"gmacs": self.gmacs}
        paired = self.base.speedup  # median of the paired per-round ratios
        headline = self.metrics[0]
        return {
            # Percentages of image counts: rounded, so that a drop of exactly the bound (8.8 -
            # 6.8) is not 2.000000000000001 and failed; distinct drops differ far more.
            "acc_drop": round(self.base.accuracy[headline] - self.accuracy[headline], 9),
            "speedup": paired.median if paired else None,
            "gmacs": self.base.measured["model"].macs / 1e9,
        }


def eval_model(
    request: ModelRequest,
    data: DataRequest,
    base_request: BaseRequest | None,
    loader: dict[str, Any],
    timing: TimingOptions | None,
    bounds: Bounds,
    task: str = "classification",
    images: int | None = None,
    progress: Callable[[str], EvalProgress] = _no_progress,
) -> EvalResult:
    """Top-1/top-5 of ``request`` on ``data``; with ``base_request``, of both models, with their
    cost and paired speed-up. ``loader``: ``batch_size``, ``device`` and ``num_workers`` of
    the evaluation. ``task="segmentation"``: mean IoU and pixel accuracy on a set of per-pixel
    labels instead (a task the data does not have is refused in one line). ``images``: that
    many images spread evenly over the split (``--val-images``; default all).
    ``progress(description)`` hears of each evaluation's images."""
    unavailable = {}
    if base_request is None:
        unavailable = {
            g: "needs --base to compare against" for g in ("max_acc_drop", "min_speedup")
        }
    if timing is None:
        unavailable.setdefault("min_speedup", NO_THROUGHPUT)
    require(bounds, unavailable)
    loaded = request.load()
    dataset, _ = data.for_model(loaded.model, loaded.input_size)
    check_task(dataset, task, data.source)
    config = dataset.data_config  # as the images are brought (Fashion-MNIST is never cropped)
    dataset = spread_subset(dataset, images)
    result = EvalResult(
        spec=request.spec,
        data=str(data.source),
        split=data.split,
        input_size=loaded.input_size,
        accuracy=score(task, loaded.model, dataset, loader, progress(request.spec)),
        data_config=config,
        identity=model_identity(loaded, request.spec),
        task=task,
    )
    if base_request is not None:
        result.base = _compare_with_base(
            base_request, loaded, data, dataset, config, loader, timing, task, images, progress
        )
    elif bounds.max_gmacs is not None:  # only the gate needs the MACs of a lone model
        result.gmacs = (
            measure_models({"model": loaded.model}, loaded.input_size, None)[0]["model"].macs / 1e9
        )
    interval = result.base.speedup.interval if result.base and result.base.speedup else None
    result.gates = check_gates(bounds, result.gate_values(), intervals={"speedup": interval})
    labels = [(config, request.spec)]
    if result.base is not None:
        labels.append((result.base.data_config, f"the base {result.base.spec}"))
    result.notes = [note for c, label in labels if (note := defaults_note(c, label))]
    identities = [(result.identity, request.spec)]
    if result.base is not None:
        identities.append((result.base.identity, f"the base {result.base.spec}"))
    result.notes += [
        f"note: {label} has random weights (no --pretrained, --checkpoint or fine-tuning): its "
        "accuracy is that of an untrained model"
        for identity, label in identities
        if untrained(identity)
    ]
    return result


def _compare_with_base(
    request: BaseRequest,
    loaded: LoadedModel,
    data: DataRequest,
    dataset: Dataset,
    config: DataConfig,
    loader: dict[str, Any],
    timing: TimingOptions | None,
    task: str = "classification",
    images: int | None = None,
    progress: Callable[[str], EvalProgress] = _no_progress,
) -> BaseComparison:
    from vitcompress.workflows.inputs import load_base

    base = load_base(request, loaded)
    base_set, _ = data.for_model(base.model, loaded.input_size)
    base_config = base_set.data_config
    # The same images when both configs agree (equality ignores where each value came from).
    evaluated = dataset if base_config == config else spread_subset(base_set, images)
    try:
        accuracy = score(task, base.model, evaluated, loader, progress(f"base {request.spec}"))
    except DataError as e:  # say which of the two models it is about
        raise DataError(f"--base {request.spec}: {e}") from e
    models = {"base": base.model, "model": loaded.model}
    measured, environment = measure_models(models, loaded.input_size, timing)
    # What was compared: "source" stands for the artifact's recorded base, so name that.
    spec, checkpoint, pretrained = request.spec, request.checkpoint, request.pretrained
    if request.from_artifact:
        spec, checkpoint = base.source.spec, base.source.checkpoint
        pretrained = base.source.pretrained
    return BaseComparison(
        spec=spec,
        identity=model_identity(base, spec),
        weights=checkpoint or ("timm pretrained" if pretrained else None),
        accuracy=accuracy,
        data_config=base_config,
        measured=measured,
        speedup=speedup(measured["model"], measured["base"]),  # what --min-speedup compares
        environment=environment,
    )
