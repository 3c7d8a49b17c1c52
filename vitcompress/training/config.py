"""What a fine-tuning run is given and what it reports: its configuration, the progress
interface, the two ways a run ends early (divergence, interrupt), and the refusals of what it is
given before anything runs (a head that cannot fit the data, sharding it does not support)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vitcompress.data import DataError, check_task, class_names, num_classes
from vitcompress.data.segmentation import SEGMENTATION, TASKS
from vitcompress.training.evaluate import EvalProgress, unwrap_logits
from vitcompress.training.run_directory import FinetuneError

StepCallback = Callable[[int, nn.Module], None]


class TrainingDiverged(FinetuneError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""

    exit_code = 1  # not the input's fault as such: the run failed


class FinetuneInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM (or a ``KeyboardInterrupt``) between optimizer steps.

    ``checkpoint`` holds the last completed step, or is None when nothing could be saved (a
    second signal forced the stop, or the interrupt came in the middle of an update); the
    message is the one line the command prints."""

    def __init__(
        self, reason: str, step: int, checkpoint: Path | None, latest: Path | None = None
    ) -> None:
        self.reason, self.step, self.checkpoint = reason, step, checkpoint
        if checkpoint is not None:
            text = (
                f"interrupted ({reason}): step {step} saved in {checkpoint}; continue with --resume"
            )
        elif latest is not None:
            text = (
                f"interrupted ({reason}): no checkpoint written; the newest, {latest}, "
                "stands (--resume continues from it)"
            )
        else:
            text = f"interrupted ({reason}): no checkpoint written, nothing to resume"
        super().__init__(text)


class FinetuneProgress:
    """What a run reports as it goes, on the main process only; this base class shows nothing.
    The CLI's rich progress bar subclasses it."""

    def start(self, epochs: int, steps_per_epoch: int, total_steps: int | None = None) -> None:
        """Before the first step; ``total_steps``: the run's length (``--max-steps`` may end the
        last epoch early)."""

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        """``steps_done`` > 0 when a resumed run starts inside the epoch."""

    def step(self, record: dict[str, Any]) -> None:
        """After each optimizer step: the metrics-log record (step, loss, lr, img_per_s: the
        images/s since the last logged step)."""

    def epoch_done(self, summary: dict[str, Any]) -> None:
        """After each epoch: train loss and, with validation data, val_top1."""

    def stop(self) -> None:
        """After the last step, also when the run fails or is interrupted."""

    def note(self, text: str) -> None:
        """A line the user should read (where a resumed run picked up, a data config value
        nobody stated)."""

    def evaluation(self) -> EvalProgress:
        """What hears of one validation's batches (its own bar); this base class shows nothing."""
        return EvalProgress()


@dataclass
class FinetuneConfig:
    epochs: int = 30
    batch_size: int = 128  # per process
    accum: int = 1
    lr: float | None = None  # None: batch x accum x processes / 1024 x 2.5e-4
    warmup_epochs: float = 5.0
    weight_decay: float = 0.05
    ratio_weight: float = 2.0
    distill_weight: float = 0.5
    token_distill_weight: float = 0.5
    ema_decay: float | None = None
    amp: str | None = None  # None, "bf16" or "fp16"
    max_steps: int | None = None  # the run's length in optimizer steps; overrides ``epochs``
    val_images: int | None = None  # validate on this many images spread over the set; None: all
    save_every: int = 0  # optimizer steps; 0: only at the end of each epoch
    keep_checkpoints: int = 2
    resume: bool = False
    seed: int = 0
    num_workers: int = 0
    log_every: int = 10
    mixup: dict[str, Any] | None = None  # keyword arguments of timm.data.Mixup
    smoothing: float = 0.0
    fsdp: bool = False  # shard the model with FSDP2 over the processes (several processes only)
    # "classification" (one label per image) or "segmentation": per-pixel labels (H, W) and
    # per-pixel logits (B, classes, H, W); cross-entropy and distillation per pixel, mIoU.
    task: str = "classification"
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the artifact's summary


def trajectory_settings(config: FinetuneConfig, lr: float, processes: int) -> dict[str, Any]:
    """The settings that decide a run's steps, by the option that sets each: a checkpoint
    records them, and a resumed run must ask for the same (``--epochs``, ``--max-steps``,
    saving, logging and validation may change: a resumed run may be longer)."""
    settings = {
        "--batch-size": config.batch_size,
        "--accum": config.accum,
        "processes": processes,
        "--lr": lr,
        "--warmup-epochs": config.warmup_epochs,
        "--weight-decay": config.weight_decay,
        "--ratio-weight": config.ratio_weight,
        "--distill-weight": config.distill_weight,
        "--token-distill-weight": config.token_distill_weight,
        "--ema-decay": config.ema_decay,
        "--amp": config.amp,
        "--seed": config.seed,
        "mixup": config.mixup,
        "label smoothing": config.smoothing,
    }
    for key, name in _RECORDED_SETTINGS:
        if key in config.extra:
            settings[name] = config.extra[key]
    # As a checkpoint gives them back: tuples as lists, numbers as JSON has them.
    return json.loads(json.dumps(settings))


# What the command's ``extra`` records that also decides the steps: the plan and the inputs.
_RECORDED_SETTINGS = (
    ("variant", "--variant"),
    ("keep", "--keep"),
    ("locs", "--locs"),
    ("augment", "--augment"),
    ("data_config", "the data config"),
)


def _check_same_settings(path: Path, recorded: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """Refuse a resume that asks for other settings than the checkpoint was written with: the
    optimizer and schedule come back from the checkpoint, so a changed option would be ignored
    while the artifact recorded it. Checkpoints from before settings were recorded pass."""
    if recorded is None:
        return
    changed = [name for name in now if recorded.get(name, now[name]) != now[name]]
    if changed:
        then = ", ".join(f"{name} {_shown(recorded[name])}" for name in changed)
        asked = ", ".join(f"{name} {_shown(now[name])}" for name in changed)
        raise FinetuneError(
            f"{path} was written with {then}; this run asks for {asked}: resume with the same "
            "options, or fine-tune into a new --out"
        )


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def check_data(
    model: nn.Module, train_set: Dataset, val_set: Dataset | None, config: FinetuneConfig
) -> None:
    """The checks on the data before a run writes anything: the task, the splits' classes and
    the model's outputs against them."""
    _check_task(train_set, config)
    _check_classes(train_set, val_set)
    _check_outputs(model, train_set, bool(config.mixup), config.task)


def _check_task(train_set: Dataset, config: FinetuneConfig) -> None:
    """Refuse a task the data cannot be trained on, and mixup on per-pixel labels, in one
    line, before anything runs."""
    if config.task not in TASKS:
        raise FinetuneError(f"unknown task {config.task!r}: expected one of {', '.join(TASKS)}")
    check_task(train_set, config.task)
    if config.task == SEGMENTATION and config.mixup:
        raise FinetuneError(
            "mixup/cutmix mix one label per image and do not apply to per-pixel labels; "
            "drop them (augment preset 'none' or 'light') for --task segmentation"
        )


def _check_classes(train_set: Dataset, val_set: Dataset | None) -> None:
    """Refuse validation data whose classes are not the training data's, in the same order: a
    label means a class by its place in the list, so a folder missing from one split shifts
    every label after it, and validation would score a trained model near chance."""
    if val_set is None:
        return
    train, val = class_names(train_set), class_names(val_set)
    if train is None or val is None or train == val:
        return
    missing = [name for name in train if name not in val]
    extra = [name for name in val if name not in train]
    if missing or extra:
        differences = ", ".join(
            part
            for part in (
                f"validation lacks {_listed(missing)}" if missing else "",
                f"validation has {_listed(extra)} that training lacks" if extra else "",
            )
            if part
        )
    else:
        differences = "the same names in another order"
    raise FinetuneError(
        f"the training and validation data name different classes ({differences}): "
        "give both splits the same class folders"
    )


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(name) for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_outputs(
    model: nn.Module, train_set: Dataset, mixup: bool, task: str = "classification"
) -> None:
    """Refuse a head that cannot fit the data before anything runs: fewer outputs than classes
    fails at the first label past them, and mixup's soft targets are sized to the data's classes,
    so with mixup the counts must be equal. A larger head is allowed otherwise. For
    segmentation the outputs are per pixel: (B, classes, H, W) at the labels' H, W."""
    try:
        classes = num_classes(train_set)
    except DataError:  # a plain dataset without .classes: nothing to compare with
        return
    if len(train_set) == 0:  # type: ignore[arg-type]
        return  # reported with the batch size below
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            image = train_set[0][0].unsqueeze(0).to(next(model.parameters()).device)
            logits = unwrap_logits(model(image))
    finally:
        model.train(was_training)
    outputs = logits.shape[-1]
    if task == SEGMENTATION:
        labels = torch.as_tensor(train_set[0][1])
        if logits.dim() != 4 or logits.shape[-2:] != labels.shape[-2:]:
            raise FinetuneError(
                f"the model returns {tuple(logits.shape)}, not per-pixel logits (B, classes, "
                f"{labels.shape[-2]}, {labels.shape[-1]}) matching the labels: --task "
                "segmentation needs a segmentation model"
            )
        outputs = logits.shape[1]
    if outputs < classes or (mixup and outputs != classes):
        why = " (mixup's targets have one column per class)" if outputs > classes else ""
        raise FinetuneError(
            f"the model predicts {outputs} classes but the data has {classes}"
            f"{why}: pass e.g. --model-arg num_classes={classes} (a new head)"
        )


def _check_distributed(accelerator: Any) -> None:
    """Refuse sharded training: checkpoints and the artifact are written from the first
    process's ``state_dict()``, which under FSDP or DeepSpeed ZeRO holds only its shard (a
    silently incomplete model). DDP keeps a whole copy in every process."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    for name in ("FSDP", "DEEPSPEED"):
        if kind.endswith(name):
            fsdp = ", with --fsdp to shard the model with FSDP2" if name == "FSDP" else ""
            raise FinetuneError(
                f"{name} is not supported by finetune (its checkpoints would hold "
                "one shard of the model); launch with DDP instead, e.g. "
                f"accelerate launch --multi_gpu{fsdp} (docs/finetune.md)"
            )


def _check_fsdp(accelerator: Any, config: FinetuneConfig) -> None:
    """What --fsdp does not cover is refused before anything is written."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    if accelerator.num_processes < 2:
        raise FinetuneError(
            "--fsdp needs several processes (start them with torchrun or "
            "accelerate launch); one process trains without it"
        )
    if not kind.endswith(("MULTI_CPU", "MULTI_GPU")):
        raise FinetuneError(
            "--fsdp runs on CPU or CUDA processes launched for DDP, not under "
            f"{kind.rsplit('.', 1)[-1]}"
        )
    if config.ema_decay:
        raise FinetuneError(
            "--fsdp with --ema-decay is not supported (the EMA copy is not "
            "sharded); drop one of them"
        )
    if config.amp:
        raise FinetuneError(
            "--fsdp with --amp is not supported (FSDP2 takes its precision "
            "from its own policy, not from autocast); drop one of them"
        )


def _check_finite(loss: torch.Tensor, accelerator: Any, step: int) -> None:
    finite = torch.isfinite(loss.detach()).float()
    if accelerator.num_processes > 1:
        # Every process must stop together, or the others wait forever in the next all-reduce.
        finite = accelerator.reduce(finite.reshape(1).to(accelerator.device), reduction="mean")
    if float(finite.min()) < 1:
        raise TrainingDiverged(
            f"loss is not finite at step {step} (value {float(loss.detach())}); stopped, the last "
            "good checkpoint is kept"
        )
