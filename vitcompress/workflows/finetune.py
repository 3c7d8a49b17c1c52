"""Fine-tune a compressed model with the paper's losses (docs/finetune.md).

One Accelerate loop, run by ``FinetuneRun`` (vitcompress/training/loop.py): the same
code runs on one CPU, one GPU, or several processes started by ``accelerate launch`` (DDP).
On CPU a run is deterministic for a given seed, and a run resumed from a checkpoint ends with
the same weights as an uninterrupted one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitcompress.data import AugmentConfig, DataConfig, DataError
from vitcompress.loading import LoadedModel
from vitcompress.status import warn
from vitcompress.training.config import (  # noqa: F401 - tests import the checks here
    FinetuneConfig,
    FinetuneInterrupted,
    FinetuneProgress,
    StepCallback,
    TrainingDiverged,
    _check_distributed,
    _check_finite,
    _check_outputs,
)
from vitcompress.training.interrupt import StopSignals
from vitcompress.training.loop import FinetuneRun
from vitcompress.training.run_directory import (
    CHECKPOINTS,
    EMA_DIR,
    METRICS,
    FinetuneError,
    prepare_run_directory,
)
from vitcompress.workflows.inputs import DataRequest, ModelRequest, PlanRequest

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINTS",
    "EMA_DIR",
    "METRICS",
    "FinetuneConfig",
    "FinetuneError",
    "FinetuneInterrupted",
    "FinetuneProgress",
    "FinetuneRun",
    "StepCallback",
    "TrainingDiverged",
    "FinetuneReport",
    "finetune",
    "finetune_model",
    "fit_head_and_teacher",
    "student_and_teacher",
]

AUGMENT_PRESETS = {
    "deit": AugmentConfig.deit,
    "light": AugmentConfig.light,
    "none": AugmentConfig.none,
}


def finetune(
    student: LoadedModel,
    teacher: nn.Module | None,
    train_set: Dataset,
    val_set: Dataset | None,
    out: str | Path,
    config: FinetuneConfig,
    on_step: StepCallback | None = None,
    progress: FinetuneProgress | None = None,
) -> dict[str, Any]:
    """Fine-tune ``student.model`` (a compressed model) and write ``out`` as its artifact.

    ``teacher`` is the uncompressed model (frozen; None disables both distillation terms).
    ``on_step(global_step, model)`` runs after every optimizer step (progress hooks, tests).
    ``progress`` hears of epochs and steps on the main process. Returns the summary recorded in
    the artifact; its ``history`` lists every epoch of the run, also across resumes.

    SIGINT and SIGTERM (from the main thread) stop the run at the next safe point: after the
    current step, between batches, or at once inside evaluation. The last completed optimizer
    step is checkpointed and ``FinetuneInterrupted`` (a ``KeyboardInterrupt``) is raised; so is
    it after a ``KeyboardInterrupt`` raised by ``on_step``.
    """
    with StopSignals() as signals:
        return FinetuneRun(
            student,
            teacher,
            train_set,
            val_set,
            out,
            config,
            signals,
            on_step=on_step,
            progress=progress,
        ).run()


def student_and_teacher(
    loaded: LoadedModel, variant: str, keep: Any, locs: Any, policy: str
) -> tuple[LoadedModel, nn.Module, bool]:
    """The compressed student and the uncompressed teacher for ``loaded``.

    A compressed artifact is fine-tuned as it is (the plan arguments do not apply); its teacher
    is rebuilt from the base source the artifact records, with the base weights it names.
    Returns ``(student, teacher, from_artifact)``.
    """
    from vitcompress.compilation.metadata import compression_info
    from vitcompress.measure.keep_fit import compress_planned

    info = compression_info(loaded.model)
    artifact = info.artifact if info is not None else None
    if artifact is None:
        student = compress_planned(loaded, variant, keep, locs, policy)
        return student, loaded.model, False
    from vitcompress.artifacts.artifact import base_source, base_weights_problem, read_meta
    from vitcompress.compilation.entries import entry_of, entry_view
    from vitcompress.loading import load_base_model

    source = base_source(read_meta(artifact))
    problem = base_weights_problem(source)
    if problem is not None:  # fine-tuning can go on; only distillation loses its meaning
        log.warning("%s: the teacher is the base model with its initial weights", problem)
    teacher = load_base_model(
        source.spec,
        source.model_args,
        checkpoint=None if problem else source.checkpoint,
        pretrained=source.pretrained,
        input_size=loaded.input_size,
    ).model
    # The method the artifact compressed (its --entry), so the teacher answers as the student.
    return loaded, entry_view(teacher, entry_of(loaded.model)), True


@dataclass
class FinetuneReport:
    """The run's summary (as the artifact records it) and the plan the model was trained with;
    ``main_process``: this process reports it (one summary per run, not one per process)."""

    summary: dict[str, Any]
    out: str
    main_process: bool = True

    def to_json(self) -> dict[str, Any]:
        return self.summary


def finetune_model(
    request: ModelRequest,
    plan: PlanRequest,
    data: DataRequest,
    augment: str | None,
    out: str,
    config: FinetuneConfig,
    progress: FinetuneProgress | None = None,
    keep_head: bool = False,
    teacher_request: ModelRequest | None = None,
) -> FinetuneReport:
    """``vitcompress finetune``: load and compress the model (or take a compressed one as it is),
    build the training and validation sets as the model expects its images, with the
    augmentation named (default: the data's own preset, whose mixup and smoothing the loss
    takes), fit the head to the data's classes (:func:`fit_head_and_teacher`) and fine-tune
    (:func:`finetune`). ``config.task="segmentation"`` trains per-pixel (a segmentation set, no
    mixup: only a preset's flip applies to its images and labels)."""
    import torch
    from accelerate import PartialState

    from vitcompress.compilation.metadata import compression_info
    from vitcompress.data import check_task, num_classes
    from vitcompress.data.segmentation import SEGMENTATION

    if not data.source:
        raise DataError("--data is required (on the command line or in the recipe)")
    # --out and --resume are checked before the models and the data load (the run checks them
    # again when it starts): a refusal comes first, not after minutes of loading.
    prepare_run_directory(Path(out), config.resume)
    # --seed also decides what is drawn before training: a base without weights, the
    # predictors' initial weights and a replaced head.
    torch.manual_seed(config.seed)
    loaded = request.load()
    student, teacher, from_artifact = student_and_teacher(
        loaded, plan.variant, plan.keep, plan.locs, plan.policy
    )
    if from_artifact and plan.given:
        warn(
            "--model is a compressed model: its own plan is used, "
            "--variant/--keep/--keep-for-gmacs-ratio/--locs/--policy are ignored"
        )
    sets, used = _datasets(student, data, augment, out, request.spec, progress)
    check_task(sets["train"], config.task, data.source)  # before any training
    segmentation = config.task == SEGMENTATION
    if not segmentation:  # a per-pixel head is the model's own (docs/finetune.md)
        student, teacher, config = fit_head_and_teacher(
            student, teacher, sets["train"], config, keep_head, teacher_request, progress
        )
    preset = sets["train"].augment
    info = compression_info(student.model)  # compressed: student_and_teacher made it so
    assert info is not None
    if segmentation and augment and _more_than_a_flip(preset):
        warn(
            f"--augment {augment}: only its horizontal flip applies to per-pixel labels "
            "(no crops, RandAugment, erasing or mixup)"
        )
    config = replace(
        config,
        mixup=None if segmentation else preset.mixup_args(num_classes(sets["train"])),
        smoothing=preset.smoothing,
        extra={
            "data": data.source,
            "data_config": used.to_json(),
            "data_config_sources": dict(used.sources),
            "augment": augment,
            **config.extra,
            "variant": info.plan.variant,
            "keep": info.plan.keep,
            "locs": info.plan.locs,
        },
    )
    summary = finetune(student, teacher, sets["train"], sets["val"], out, config, progress=progress)
    return FinetuneReport(summary, out, PartialState().is_main_process)


def _datasets(
    student: LoadedModel,
    data: DataRequest,
    augment: str | None,
    out: str,
    spec: str,
    progress: FinetuneProgress | None,
) -> tuple[dict[str, Any], DataConfig]:
    """The training and validation sets, brought as ``student`` expects its images, and the data
    config used, which becomes the model's own (the artifact records it, docs/data.md)."""
    from vitcompress.compilation.metadata import attach
    from vitcompress.data import build_dataset, resolve_data_config
    from vitcompress.data.config import defaults_note

    assert data.source is not None
    preset = AUGMENT_PRESETS[augment]() if augment else None  # None: the data's own
    data_config = resolve_data_config(student.model, student.input_size[0], data.overrides)
    sets = {
        split: build_dataset(
            data.source,
            split,
            student.input_size,
            augment=preset if split == "train" else None,
            data_dir=data.data_dir,
            data_config=data_config,
        )
        for split in ("train", "val")
    }
    used = sets["val"].data_config
    attach(
        student.model,
        vitcompress_data_config=used.to_json(),
        vitcompress_data_config_from=f"{out} (fine-tuned with it)",
    )
    if progress is not None and (note := defaults_note(used, spec)):
        progress.note(note)
    return sets, used


def fit_head_and_teacher(
    student: LoadedModel,
    teacher: nn.Module,
    train_set: Dataset,
    config: FinetuneConfig,
    keep_head: bool = False,
    teacher_request: ModelRequest | None = None,
    progress: FinetuneProgress | None = None,
) -> tuple[LoadedModel, nn.Module, FinetuneConfig]:
    """The student with a head of the data's classes (replaced, and said so in one line, unless
    ``keep_head``, which refuses a mismatch), and the teacher: ``teacher_request``'s model, which
    must predict the data's classes, else the base. The base's head predicts what the student's
    predicted before its head was replaced, so its logits teach nothing: logit distillation is
    then turned off (said so), and token distillation, which reads the base's features, stays.
    """
    from vitcompress.data import check_task, num_classes
    from vitcompress.training.head import HeadError, fit_head, model_outputs

    check_task(train_set, config.task)  # before its first image is read as a class label
    classes = num_classes(train_set)
    image = train_set[0][0]
    student, change = fit_head(student, classes, image, keep_head)
    lines = [change.line()] if change is not None else []
    if teacher_request is not None:  # checked before anything is said about the head
        loaded = replace(teacher_request, input_size=student.input_size).load()
        outputs = model_outputs(loaded.model, image)
        if outputs != classes:
            raise HeadError(
                f"--teacher {teacher_request.spec} predicts {outputs} classes but the data has "
                f"{classes}: a teacher must predict the data's classes"
            )
        teacher = loaded.model
    elif change is not None and config.distill_weight:
        lines.append(
            f"logit distillation is off: the base's head predicts {change.before} classes, "
            f"not the data's {change.after} (--teacher names a model that predicts them); "
            "token distillation from the base stays"
        )
        config = replace(config, distill_weight=0.0)
    say = progress.note if progress is not None else log.warning
    for line in lines:
        say(line)
    return student, teacher, config


def _more_than_a_flip(preset: AugmentConfig) -> bool:
    """The preset asks for augmentation other than a horizontal flip."""
    return (
        preset.mixup > 0
        or preset.cutmix > 0
        or preset.rand_augment is not None
        or preset.random_erasing > 0
        or bool(preset.color_jitter)
        or tuple(preset.crop_scale) != (1.0, 1.0)
    )
