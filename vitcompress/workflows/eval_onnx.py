"""``vitcompress eval --model FILE.onnx``: the accuracy of an exported file run in onnxruntime, and
with a reference (the float32 ONNX file, or the PyTorch model it was exported from) how often the
two agree on the predicted class.

The file is evaluated as :func:`~vitcompress.workflows.eval_run.eval_model` evaluates a PyTorch
model: the same dataset built for the same data config, the same images spread over the split,
and the same loop (:func:`~vitcompress.training.evaluate.evaluate`), so the numbers compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from vitcompress.data import DataConfig, DataError, num_classes
from vitcompress.data.config import OPTIONS, defaults_note
from vitcompress.measure.logits import unwrap_logits
from vitcompress.measure.onnx_eval import (
    OnnxClassifier,
    OnnxFileError,
    OnnxFileFacts,
    is_onnx_path,
    read_onnx_facts,
)
from vitcompress.training.evaluate import EvalProgress, evaluate, spread_subset
from vitcompress.workflows.inputs import DataRequest, ModelRequest

__all__ = ["OnnxEvalResult", "ReferenceAgreement", "eval_onnx"]

# The options that stand in for a record of the preprocessing, all three needed (a crop the
# images' size decides, as for any model that states none).
NEEDED_OPTIONS = ("mean", "std", "interpolation")


def _no_progress(description: str) -> EvalProgress:
    return EvalProgress()


class _Predictions(nn.Module):
    """``model`` unchanged, keeping the predicted class of every image it is run on, in order."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.batches: list[Tensor] = []

    def forward(self, images: Tensor) -> Any:
        output = self.model(images)
        self.batches.append(unwrap_logits(output).argmax(dim=-1).cpu())
        return output

    def argmax(self) -> Tensor:
        return torch.cat(self.batches) if self.batches else torch.empty(0, dtype=torch.long)


@dataclass
class ReferenceAgreement:
    """The reference's own accuracy and how often its predicted class is the file's
    (``agreement``, percent of ``images``; ``disagreements`` counted)."""

    spec: str
    runtime: str  # onnxruntime or pytorch
    accuracy: dict[str, Any]
    agreement: float
    disagreements: int
    data_config: DataConfig

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "runtime": self.runtime,
            "top1": self.accuracy["top1"],
            "top5": self.accuracy["top5"],
            "agreement": self.agreement,
            "disagreements": self.disagreements,
            "data_config": self.data_config.to_json(),
            "data_config_sources": dict(self.data_config.sources),
        }


@dataclass
class OnnxEvalResult:
    spec: str
    data: str
    split: str
    facts: OnnxFileFacts
    accuracy: dict[str, Any]  # top1, top5 (percent), images
    data_config: DataConfig
    reference: ReferenceAgreement | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "model": self.spec,
            "runtime": "onnxruntime",
            "data": self.data,
            "split": self.split,
            "input_size": list(self.facts.input_size),
            "file_batch": self.facts.batch,
            "bytes": self.facts.bytes,
            "images": self.accuracy["images"],
            "top1": self.accuracy["top1"],
            "top5": self.accuracy["top5"],
            "data_config": self.data_config.to_json(),
            "data_config_sources": dict(self.data_config.sources),
        }
        if self.reference is not None:
            result["reference"] = self.reference.to_json()
            result["agreement"] = self.reference.agreement
            result["delta_top1"] = self.accuracy["top1"] - self.reference.accuracy["top1"]
        return result


@dataclass
class _Evaluated:
    """One model of the pair: its module, dataset (its own preprocessing) and config."""

    spec: str
    runtime: str
    model: nn.Module
    input_size: tuple[int, ...]
    dataset: Dataset | None = None
    config: DataConfig | None = None


def eval_onnx(
    spec: str,
    data: DataRequest,
    loader: dict[str, Any],
    reference: str | None = None,
    images: int | None = None,
    progress: Callable[[str], EvalProgress] = _no_progress,
) -> OnnxEvalResult:
    """Top-1/top-5 of the ONNX file ``spec`` on ``data`` in onnxruntime; with ``reference`` (an
    ONNX file, or a model spec such as the compressed model directory the file was exported
    from), that model's accuracy on the same images and the argmax agreement of the two.

    The file's preprocessing is what it records (``metadata_props``); a file that records none
    takes the reference's, or ``--mean``/``--std``/``--interpolation`` given together; without
    any of these it is refused in one line. ``loader``: ``batch_size`` and ``num_workers`` of the
    evaluation (onnxruntime runs on the CPU).
    """
    facts = read_onnx_facts(spec)
    main = _Evaluated(spec, "onnxruntime", OnnxClassifier(facts), facts.input_size)
    other = _load_reference(reference, facts) if reference is not None else None
    _bring_data(main, other, data, facts)
    assert main.dataset is not None and main.config is not None
    _check_classes(facts, main.dataset)
    main.dataset = spread_subset(main.dataset, images)
    cpu_loader = {**loader, "device": "cpu"}
    recorder = _Predictions(main.model)
    accuracy = evaluate(
        recorder, main.dataset, **cpu_loader, exact_head=True, progress=progress(spec)
    )
    result = OnnxEvalResult(spec, str(data.source), data.split, facts, accuracy, main.config)
    if other is not None:
        result.reference = _agreement(other, main, recorder.argmax(), cpu_loader, images, progress)
    labels = [(main.config, spec)]
    if other is not None and other.config is not None:
        labels.append((other.config, f"the reference {other.spec}"))
    result.notes = [note for c, label in labels if (note := defaults_note(c, label))]
    return result


def _load_reference(reference: str, facts: OnnxFileFacts) -> _Evaluated:
    if is_onnx_path(reference):
        reference_facts = read_onnx_facts(reference)
        if reference_facts.input_size != facts.input_size:
            raise OnnxFileError(
                f"--reference {reference} takes input {reference_facts.input_size}, "
                f"{facts.path} takes {facts.input_size}: they are not the same model"
            )
        return _Evaluated(
            reference, "onnxruntime", OnnxClassifier(reference_facts), facts.input_size
        )
    loaded = ModelRequest(reference, input_size=facts.input_size).load()
    return _Evaluated(reference, "pytorch", loaded.model, loaded.input_size)


def _stated(model: nn.Module) -> bool:
    return getattr(model, "vitcompress_data_config", None) is not None


def _bring_data(
    main: _Evaluated, other: _Evaluated | None, data: DataRequest, facts: OnnxFileFacts
) -> None:
    """Each model's dataset and config. A file without a record takes the reference's resolved
    config (what the model it was exported from is fed), or the options that say it all."""
    if other is not None and (other.runtime == "pytorch" or _stated(other.model)):
        other.dataset, other.config = _brought(data, other)
    if not _stated(main.model):
        missing = [name for name in NEEDED_OPTIONS if name not in data.overrides]
        if other is not None and other.config is not None:
            main.model.vitcompress_data_config = other.config.to_json()
            main.model.vitcompress_data_config_from = f"the reference {other.spec}"
        elif missing:
            raise OnnxFileError(
                f"{facts.path} records no preprocessing (metadata_props "
                f"'vitcompress.data_config'): pass --reference with the model it was exported "
                f"from, or {', '.join(OPTIONS[name] for name in NEEDED_OPTIONS)}"
            )
    main.dataset, main.config = _brought(data, main)
    if other is not None and other.dataset is None:  # an ONNX reference that records nothing
        other.model.vitcompress_data_config = main.config.to_json()
        other.model.vitcompress_data_config_from = f"the evaluated file {main.spec}"
        other.dataset, other.config = _brought(data, other)


def _brought(data: DataRequest, evaluated: _Evaluated) -> tuple[Dataset, DataConfig]:
    """The split brought to the model, and the config as the images are brought (with the crop
    the images' size chose), as ``eval_model`` reports it."""
    dataset, _ = data.for_model(evaluated.model, evaluated.input_size)
    return dataset, dataset.data_config


def _check_classes(facts: OnnxFileFacts, dataset: Dataset) -> None:
    try:
        classes = num_classes(dataset)
    except DataError:  # a plain dataset without .classes: nothing to check against
        return
    if facts.classes is not None and facts.classes != classes:
        raise OnnxFileError(
            f"{facts.path} predicts {facts.classes} classes but the data has {classes}: it was "
            "exported from a model with another head"
        )


def _agreement(
    other: _Evaluated,
    main: _Evaluated,
    predicted: Tensor,
    loader: dict[str, Any],
    images: int | None,
    progress: Callable[[str], EvalProgress],
) -> ReferenceAgreement:
    """The reference's accuracy on the same images (its own preprocessing; the same dataset when
    both configs agree) and how often its argmax is the file's."""
    assert other.dataset is not None and other.config is not None
    same = other.config == main.config
    evaluated = main.dataset if same else spread_subset(other.dataset, images)
    assert evaluated is not None
    recorder = _Predictions(other.model)
    try:
        accuracy = evaluate(
            recorder,
            evaluated,
            **loader,
            exact_head=True,
            progress=progress(f"reference {other.spec}"),
        )
    except DataError as e:  # say which of the two models it is about
        raise DataError(f"--reference {other.spec}: {e}") from e
    theirs = recorder.argmax()
    disagreements = int((theirs != predicted).sum())
    return ReferenceAgreement(
        spec=other.spec,
        runtime=other.runtime,
        accuracy=accuracy,
        agreement=100.0 * (1 - disagreements / max(1, predicted.numel())),
        disagreements=disagreements,
        data_config=other.config,
    )
