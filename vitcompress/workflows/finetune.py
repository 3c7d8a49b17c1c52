"""Fine-tune a compressed model with the paper's losses (docs/finetune.md).

One Accelerate loop, run by ``FinetuneRun`` (vitcompress/workflows/finetune_run.py): the same
code runs on one CPU, one GPU, or several processes started by ``accelerate launch`` (DDP).
On CPU a run is deterministic for a given seed, and a run resumed from a checkpoint ends with
the same weights as an uninterrupted one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitcompress.loading import LoadedModel
from vitcompress.training.interrupt import StopSignals
from vitcompress.workflows.finetune_config import (
    FinetuneConfig,
    FinetuneInterrupted,
    FinetuneProgress,
    StepCallback,
    TrainingDiverged,
)
from vitcompress.workflows.finetune_run import (  # noqa: F401 - the checks are imported by tests
    FinetuneRun,
    _check_distributed,
    _check_finite,
    _check_outputs,
)
from vitcompress.workflows.run_directory import CHECKPOINTS, EMA_DIR, METRICS, FinetuneError

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
    "finetune",
    "student_and_teacher",
]


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
    from vitcompress.api import compress_loaded
    from vitcompress.metadata import compression_info

    info = compression_info(loaded.model)
    artifact = info.artifact if info is not None else None
    if artifact is None:
        student = compress_loaded(loaded, variant=variant, keep=keep, locs=locs, policy=policy)
        return student, loaded.model, False
    from vitcompress.artifact import base_source, base_weights_problem, read_meta
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
    return loaded, teacher, True
