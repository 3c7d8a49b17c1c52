"""Fine-tune a compressed model with the paper's losses (docs/finetune.md).

One Accelerate loop: the same code runs on one CPU, one GPU, or several processes started by
``accelerate launch`` (DDP; FSDP/DeepSpeed through ``accelerate config``). On CPU a run is
deterministic for a given seed, and a run resumed from a checkpoint ends with the same weights
as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vitcompress.data import DataError, num_classes
from vitcompress.loading import LoadedModel
from vitcompress.training.checkpoint import (
    checkpoint_name,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from vitcompress.training.interrupt import ForcedStop, StopSignals
from vitcompress.training.losses import DistillationTaps, FinetuneLoss, LossWeights
from vitcompress.training.optim import build_optimizer, build_scheduler, default_lr
from vitcompress.training.sampler import EpochSampler, TrainPosition
from vitcompress.workflows.evaluate import evaluate, evaluate_top1, unwrap_logits
from vitcompress.workflows.run_directory import (
    CHECKPOINTS,
    EMA_DIR,
    METRICS,
    FinetuneError,
    MetricsLog,
    prepare_run_directory,
    write_artifact_into,
)

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINTS", "EMA_DIR", "METRICS", "FinetuneConfig", "FinetuneError",
           "FinetuneInterrupted", "FinetuneProgress", "TrainingDiverged", "finetune",
           "student_and_teacher"]


class TrainingDiverged(FinetuneError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class FinetuneInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM (or a ``KeyboardInterrupt``) between optimizer steps.

    ``checkpoint`` holds the last completed step, or is None when nothing could be saved (a
    second signal forced the stop, or the interrupt came in the middle of an update); the
    message is the one line the command prints."""

    def __init__(self, reason: str, step: int, checkpoint: Path | None,
                 latest: Path | None = None) -> None:
        self.reason, self.step, self.checkpoint = reason, step, checkpoint
        if checkpoint is not None:
            text = (f"interrupted ({reason}): step {step} saved in {checkpoint}; continue with "
                    "--resume")
        elif latest is not None:
            text = (f"interrupted ({reason}): no checkpoint written; the newest, {latest}, "
                    "stands (--resume continues from it)")
        else:
            text = f"interrupted ({reason}): no checkpoint written, nothing to resume"
        super().__init__(text)


class _StopAgreed(Exception):
    """Every process saw a stop request at the same safe point."""


class FinetuneProgress:
    """What a run reports as it goes, on the main process only; this base class shows nothing.
    The CLI's rich progress bar subclasses it."""

    def start(self, epochs: int, steps_per_epoch: int, total_steps: int | None = None) -> None:
        """Before the first step; ``total_steps``: the run's length (``--max-steps`` may end the
        last epoch early)."""

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        """``steps_done`` > 0 when a resumed run starts inside the epoch."""

    def step(self, record: dict[str, Any]) -> None:
        """After each optimizer step: the metrics-log record (step, loss, lr, img_per_s...)."""

    def epoch_done(self, summary: dict[str, Any]) -> None:
        """After each epoch: train loss and, with validation data, val_top1."""

    def stop(self) -> None:
        """After the last step, also when the run fails or is interrupted."""




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
    save_every: int = 0  # optimizer steps; 0: only at the end of each epoch
    keep_checkpoints: int = 2
    resume: bool = False
    seed: int = 0
    num_workers: int = 0
    log_every: int = 10
    mixup: dict[str, Any] | None = None  # keyword arguments of timm.data.Mixup
    smoothing: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the artifact's summary


def _top1(model: nn.Module, dataset: Dataset, loader: DataLoader, accelerator: Any,
          config: FinetuneConfig) -> float:
    """Top-1 as a fraction. One process: the project's ``evaluate`` (same numbers as the ``eval``
    command); several: a loop that gathers predictions from every process."""
    if accelerator.num_processes == 1:
        result = evaluate(accelerator.unwrap_model(model), dataset, batch_size=config.batch_size,
                          device=str(accelerator.device), num_workers=config.num_workers)
        return result["top1"] / 100
    return evaluate_top1(model, loader, accelerator)


StepCallback = Callable[[int, nn.Module], None]


def finetune(student: LoadedModel, teacher: nn.Module | None, train_set: Dataset,
             val_set: Dataset | None, out: str | Path, config: FinetuneConfig,
             on_step: StepCallback | None = None,
             progress: FinetuneProgress | None = None) -> dict[str, Any]:
    """Fine-tune ``student.model`` (a compressed model) and write ``out`` as its artifact.

    ``teacher`` is the uncompressed model (frozen; None disables both distillation terms).
    ``on_step(global_step, model)`` runs after every optimizer step (progress hooks, tests).
    ``progress`` hears of epochs and steps on the main process. Returns the summary recorded in
    the artifact.

    SIGINT and SIGTERM (from the main thread) stop the run at the next safe point: after the
    current step, between batches, or at once inside evaluation. The last completed optimizer
    step is checkpointed and ``FinetuneInterrupted`` (a ``KeyboardInterrupt``) is raised; so is
    it after a ``KeyboardInterrupt`` raised by ``on_step``.
    """
    with StopSignals() as signals:
        return _finetune(student, teacher, train_set, val_set, Path(out), config, on_step,
                         progress, signals)


def _finetune(student: LoadedModel, teacher: nn.Module | None, train_set: Dataset,
              val_set: Dataset | None, out: Path, config: FinetuneConfig,
              on_step: StepCallback | None, progress: FinetuneProgress | None,
              signals: StopSignals) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import gather_object, set_seed

    resume_from = prepare_run_directory(out, config.resume)
    _check_outputs(student.model, train_set, bool(config.mixup))  # before anything is written
    accelerator = Accelerator(gradient_accumulation_steps=config.accum,
                              mixed_precision=config.amp or "no")
    _check_distributed(accelerator)
    main = accelerator.is_main_process
    if main:
        out.mkdir(parents=True, exist_ok=True)
    # device_specific: each process draws different Gumbel/mixup noise; the sampler's seed
    # stays shared so the processes split one permutation.
    set_seed(config.seed, device_specific=True)

    model = student.model
    model.train()
    if teacher is not None:
        teacher = teacher.to(accelerator.device).eval().requires_grad_(False)

    sampler = EpochSampler(len(train_set), config.seed)
    train_loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler,
                              num_workers=config.num_workers, drop_last=True,
                              generator=torch.Generator().manual_seed(config.seed))
    if len(train_loader) == 0:
        raise FinetuneError(f"the training set ({len(train_set)} images) is smaller than one "
                            f"batch ({config.batch_size})")
    val_loader = (DataLoader(val_set, batch_size=config.batch_size, shuffle=False,
                             num_workers=config.num_workers) if val_set is not None else None)

    lr = config.lr if config.lr is not None else default_lr(
        config.batch_size, config.accum, accelerator.num_processes)
    optimizer = build_optimizer(model, lr, config.weight_decay)
    # The EMA copy is made before the loss taps put hooks on the model (a deepcopy would keep them).
    ema = None
    if config.ema_decay:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=config.ema_decay)
        ema.module.to(accelerator.device)
    # The taps go in before prepare: the token tap may add a node to the student's graph.
    taps = DistillationTaps(model, teacher, token_distill=config.token_distill_weight > 0)
    if val_loader is not None:
        model, optimizer, train_loader, val_loader = accelerator.prepare(
            model, optimizer, train_loader, val_loader)
    else:
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    raw_model = accelerator.unwrap_model(model)

    # The scheduler is stepped here once per optimizer step rather than prepared: a prepared
    # scheduler advances once per process per step, which would shorten the schedule under DDP.
    steps_per_epoch = math.ceil(len(train_loader) / config.accum)
    total_steps = config.max_steps or steps_per_epoch * config.epochs
    epochs = math.ceil(total_steps / steps_per_epoch)
    warmup_steps = round(config.warmup_epochs * steps_per_epoch)
    if main and 0 < total_steps <= warmup_steps:
        log.warning("warning: the warm-up (%d steps) is as long as the run (%d steps) or longer: "
                    "the learning rate never reaches its peak and never decays; lower "
                    "--warmup-epochs", warmup_steps, total_steps)
    scheduler = build_scheduler(getattr(optimizer, "optimizer", optimizer), total_steps,
                                warmup_steps)

    weights = LossWeights(config.ratio_weight, config.distill_weight, config.token_distill_weight)
    mixup_fn = None
    if config.mixup:
        from timm.data import Mixup

        mixup_fn = Mixup(**config.mixup)
    criterion = FinetuneLoss(taps, weights, mixup=mixup_fn is not None,
                             smoothing=config.smoothing)

    position = TrainPosition()
    if resume_from is not None:
        state = load_checkpoint(resume_from)
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None and accelerator.scaler is not None:
            accelerator.scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        rngs = state["rng"]
        set_rng_state(rngs[accelerator.process_index % len(rngs)])
        position = TrainPosition(state["epoch"], state["batches_done"], state["global_step"])
        if main:
            log.info("resuming from %s (epoch %d, step %d)", resume_from, position.epoch,
                     position.global_step)

    metrics = MetricsLog(out / METRICS, main)

    buffer_names = {name for name, _ in raw_model.named_buffers()}

    def buffers() -> dict[str, torch.Tensor]:
        # Forward passes in training mode may change buffers (batch-norm statistics) before the
        # step completes; a stop between batches saves them as they were at the last step.
        return {k: v.detach().clone() for k, v in raw_model.state_dict().items()
                if k in buffer_names}

    saved: dict[int, Path] = {}

    def checkpoint(pos: TrainPosition, rng: dict[str, Any]) -> Path:
        # gather_object is collective: every process calls this, only the first one writes.
        rngs = gather_object([rng])
        path = out / CHECKPOINTS / checkpoint_name(pos.global_step)
        if main:
            state = {
                "model": {**raw_model.state_dict(), **boundary_buffers},
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler else None,
                "ema": ema.state_dict() if ema is not None else None,
                "rng": rngs,
                "epoch": pos.epoch,
                "batches_done": pos.batches_done,
                "global_step": pos.global_step,
            }
            path = save_checkpoint(state, out / CHECKPOINTS, pos.global_step,
                                   config.keep_checkpoints)
        accelerator.wait_for_everyone()
        saved[pos.global_step] = path
        return path

    def stop_agreed() -> bool:
        """A safe point: True when any process has a stop request (all processes call this at
        the same points, so they stop together and the collective save cannot hang)."""
        local = signals.requested
        if accelerator.num_processes == 1:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=accelerator.device)
        agreed = float(accelerator.reduce(flag, reduction="sum")) > 0
        if agreed and not local:
            signals.request("another process was signalled")
        return agreed

    def checked(batches: Any) -> Any:
        """``batches`` with a safe point after each fetch. A DataLoader worker killed by the
        same signal (Ctrl-C reaches the whole process group) counts as the stop request."""
        iterator = iter(batches)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception:
                if not signals.requested:
                    raise
                batch = None
            if stop_agreed():
                raise _StopAgreed
            yield batch

    def top1(net: nn.Module) -> float:
        if accelerator.num_processes == 1:  # nothing evaluation does can be torn: stop at once
            with signals.immediate():
                return _top1(net, val_set, val_loader, accelerator, config)
        return _top1(net, val_set, checked(val_loader), accelerator, config)

    progress = progress if progress is not None and main else FinetuneProgress()
    boundary = TrainPosition(position.epoch, position.batches_done, position.global_step)
    boundary_rng = rng_state()
    boundary_buffers = buffers()
    updating = False
    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    progress.start(epochs, steps_per_epoch, total_steps=total_steps)
    try:
        for epoch in range(position.epoch, epochs):
            if boundary.global_step >= total_steps:  # resumed from the last step of the run
                break
            sampler.start_epoch(epoch)
            skip = position.batches_done if epoch == position.epoch else 0
            loader = (accelerator.skip_first_batches(train_loader, skip) if skip
                      else train_loader)
            batch_index = skip
            progress.start_epoch(epoch, skip // config.accum)
            epoch_loss, epoch_batches = 0.0, 0
            epoch_images, epoch_seconds = 0, 0.0
            window_images, window_start = 0, time.perf_counter()
            model.train()
            for images, labels in checked(loader):
                targets = labels
                if mixup_fn is not None:
                    images, targets = mixup_fn(images, labels)
                with accelerator.accumulate(model):
                    taps.reset()
                    with accelerator.autocast():
                        logits = unwrap_logits(model(images))
                        teacher_logits = None
                        if teacher is not None and (weights.distill or taps.token_distill):
                            with torch.no_grad():
                                teacher_logits = unwrap_logits(teacher(images))
                    loss, parts = criterion(logits, targets, teacher_logits)
                    _check_finite(loss, accelerator, boundary.global_step + 1)
                    accelerator.backward(loss)
                    updating = accelerator.sync_gradients  # the weights change from here on
                    optimizer.step()
                    optimizer.zero_grad()
                batch_index += 1
                epoch_loss += float(loss.detach())
                epoch_batches += 1
                window_images += images.shape[0] * accelerator.num_processes
                if not accelerator.sync_gradients:
                    continue
                if not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                if ema is not None:
                    ema.update(raw_model, step=boundary.global_step + 1)
                boundary = TrainPosition(epoch, batch_index, boundary.global_step + 1)
                boundary_rng = rng_state()
                boundary_buffers = buffers()
                updating = False
                step = boundary.global_step
                elapsed = time.perf_counter() - window_start
                epoch_images, epoch_seconds = epoch_images + window_images, epoch_seconds + elapsed
                record = {"type": "step", "epoch": epoch, "step": step,
                          "loss": float(loss.detach()), **parts,
                          "lr": optimizer.param_groups[0]["lr"],
                          "img_per_s": window_images / elapsed if elapsed > 0 else None}
                if step % max(1, config.log_every) == 0 or step == 1:
                    metrics.write(record)
                window_images, window_start = 0, time.perf_counter()
                progress.step(record)
                if config.save_every and step % config.save_every == 0:
                    checkpoint(boundary, boundary_rng)
                if on_step is not None:
                    on_step(step, raw_model)
                if stop_agreed():
                    raise _StopAgreed
                if step >= total_steps:  # --max-steps ends this epoch early
                    break
            summary = {"type": "epoch", "epoch": epoch, "step": boundary.global_step,
                       "train_loss": epoch_loss / max(1, epoch_batches),
                       "lr": optimizer.param_groups[0]["lr"],
                       "img_per_s": epoch_images / epoch_seconds if epoch_seconds > 0 else None}
            if val_loader is not None:
                summary["val_top1"] = top1(model)
                if ema is not None:
                    summary["val_top1_ema"] = top1(ema.module)
            metrics.write(summary)
            history.append(summary)
            progress.epoch_done(summary)
            finished = boundary.batches_done == len(train_loader)
            boundary = (TrainPosition(epoch + 1, 0, boundary.global_step) if finished
                        else boundary)  # cut by --max-steps: a longer run continues here
            boundary_rng = rng_state()
            checkpoint(boundary, boundary_rng)
    except (_StopAgreed, KeyboardInterrupt) as stop:
        progress.stop()  # before the message, which a live bar would draw over
        # Save where the last optimizer step left things (the batches of an unfinished
        # accumulation are redone on resume). Not after a forced stop or during an update, whose
        # state could be torn, and not after a KeyboardInterrupt raised on one process only,
        # whose collective save could hang.
        reason = signals.received or "KeyboardInterrupt"
        step = boundary.global_step
        if isinstance(stop, ForcedStop) or updating or (
                not isinstance(stop, _StopAgreed) and accelerator.num_processes > 1):
            raise FinetuneInterrupted(f"{reason}, stopped at once" if signals.forced else reason,
                                      step, None, find_latest(out / CHECKPOINTS)) from None
        try:
            path = saved.get(step) or checkpoint(boundary, boundary_rng)
        except ForcedStop:
            raise FinetuneInterrupted(f"{reason}, stopped at once while saving", step, None,
                                      find_latest(out / CHECKPOINTS)) from None
        raise FinetuneInterrupted(reason, step, path) from None
    except BaseException:
        progress.stop()
        raise
    finally:
        taps.remove()
    progress.stop()

    result = {
        "epochs": epochs,
        "max_steps": config.max_steps,
        "steps": boundary.global_step,
        "lr": lr,
        "effective_batch": config.batch_size * config.accum * accelerator.num_processes,
        "processes": accelerator.num_processes,
        "seed": config.seed,
        "loss_weights": asdict(weights),
        "ema_decay": config.ema_decay,
        "amp": config.amp,
        "history": history,
        "val_top1": history[-1].get("val_top1") if history else None,
        "seconds": time.perf_counter() - started,
        **config.extra,
    }
    accelerator.wait_for_everyone()
    if main:
        raw_model.eval()
        write_artifact_into(raw_model, out, student.source, student.input_size,
                        {"finetune": result})
        if ema is not None:
            write_artifact_into(ema.module, out / EMA_DIR, student.source, student.input_size,
                            {"finetune": {**result, "weights": "ema"}})
    accelerator.wait_for_everyone()
    result["out"] = str(out)
    result["checkpoints"] = [str(p) for p in list_checkpoints(out / CHECKPOINTS)]
    return result


def _check_outputs(model: nn.Module, train_set: Dataset, mixup: bool) -> None:
    """Refuse a head that cannot fit the data before anything runs: fewer outputs than classes
    fails at the first label past them, and mixup's soft targets are sized to the data's classes,
    so with mixup the counts must be equal. A larger head is allowed otherwise."""
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
            outputs = unwrap_logits(model(image)).shape[-1]
    finally:
        model.train(was_training)
    if outputs < classes or (mixup and outputs != classes):
        why = " (mixup's targets have one column per class)" if outputs > classes else ""
        raise FinetuneError(f"the model predicts {outputs} classes but the data has {classes}"
                            f"{why}: pass e.g. --model-arg num_classes={classes} (a new head)")


def _check_distributed(accelerator: Any) -> None:
    """Refuse sharded training: checkpoints and the artifact are written from the first
    process's ``state_dict()``, which under FSDP or DeepSpeed ZeRO holds only its shard (a
    silently incomplete model). DDP keeps a whole copy in every process."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    for name in ("FSDP", "DEEPSPEED"):
        if kind.endswith(name):
            raise FinetuneError(f"{name} is not supported by finetune (its checkpoints would hold "
                                "one shard of the model); launch with DDP instead, e.g. "
                                "accelerate launch --multi_gpu (docs/finetune.md)")


def _check_finite(loss: torch.Tensor, accelerator: Any, step: int) -> None:
    finite = torch.isfinite(loss.detach()).float()
    if accelerator.num_processes > 1:
        # Every process must stop together, or the others wait forever in the next all-reduce.
        finite = accelerator.reduce(finite.reshape(1).to(accelerator.device), reduction="mean")
    if float(finite.min()) < 1:
        raise TrainingDiverged(
            f"loss is not finite at step {step} (value {float(loss.detach())}); stopped, the last "
            "good checkpoint is kept")


def student_and_teacher(loaded: LoadedModel, variant: str, keep: Any, locs: Any,
                        policy: str) -> tuple[LoadedModel, nn.Module, bool]:
    """The compressed student and the uncompressed teacher for ``loaded``.

    A compressed artifact is fine-tuned as it is (the plan arguments do not apply); its teacher
    is rebuilt from the base source the artifact records, with the base weights it names.
    Returns ``(student, teacher, from_artifact)``.
    """
    from vitcompress.api import compress_loaded

    artifact = getattr(loaded.model, "vitcompress_artifact", None)
    if getattr(loaded.model, "vitcompress_plan", None) is None or artifact is None:
        student = compress_loaded(loaded, variant=variant, keep=keep, locs=locs, policy=policy)
        return student, loaded.model, False
    from vitcompress.artifact import base_source, base_weights_problem, read_meta
    from vitcompress.loading import load_model

    source = base_source(read_meta(artifact))
    problem = base_weights_problem(source)
    if problem is not None:  # fine-tuning can go on; only distillation loses its meaning
        log.warning("%s: the teacher is the base model with its initial weights", problem)
    teacher = load_model(source.spec, source.model_args,
                         checkpoint=None if problem else source.checkpoint,
                         pretrained=source.pretrained, input_size=loaded.input_size).model
    return loaded, teacher, True
