"""One fine-tuning run as an object: setup, resume, train one epoch, evaluate, checkpoint,
summary (docs/finetune.md). ``vitcompress.workflows.finetune.finetune`` drives it.

The run keeps its place as a *boundary*: the last completed optimizer step, with the RNG
states, buffers and epoch totals as they were then. A checkpoint is always written from the
boundary, so a stop between steps (or inside an unfinished accumulation) saves a whole state and
a resumed run repeats exactly what the uninterrupted one did.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vitcompress.errors import UserError
from vitcompress.loading import LoadedModel
from vitcompress.model_copy import copy_model
from vitcompress.training.checkpoint import (
    checkpoint_name,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from vitcompress.training.config import (
    FinetuneConfig,
    FinetuneInterrupted,
    FinetuneProgress,
    StepCallback,
    _check_distributed,
    _check_finite,
    _check_fsdp,
    _check_same_settings,
    check_data,
    trajectory_settings,
)
from vitcompress.training.evaluate import spread_subset, unwrap_logits
from vitcompress.training.interrupt import ForcedStop, StopSignals
from vitcompress.training.losses import DistillationTaps, FinetuneLoss, LossWeights
from vitcompress.training.metrics import EpochTotals, RateWindow, run_summary, start_record
from vitcompress.training.optim import RunLength, build_optimizer, build_scheduler, default_lr
from vitcompress.training.run_directory import (
    CHECKPOINTS,
    METRICS,
    FinetuneError,
    MetricsLog,
    prepare_run_directory,
    write_run_artifacts,
)
from vitcompress.training.sampler import TrainPosition, training_loaders
from vitcompress.training.sharding import (
    SHARDED,
    full_model_state,
    full_optimizer_state,
    load_training_state,
)
from vitcompress.training.validation import validation_metrics

# The warm-up warning is the public function's message.
log = logging.getLogger("vitcompress.workflows.finetune")


class _StopAgreed(Exception):
    """Every process saw a stop request at the same safe point."""


class FinetuneRun:
    """A fine-tuning run. ``run()`` does it all; the parts can be called alone (tests):

    ``setup()`` builds the accelerator, loaders, optimizer, schedule and loss and returns the
    checkpoint to resume from (or None); ``resume(path)`` restores the weights, optimizer,
    schedule, RNG, position, epoch totals and history; ``train_one_epoch(epoch)`` trains up to the
    epoch's end (or ``--max-steps``) and returns its training summary; ``evaluate()`` returns
    the validation metrics; ``checkpoint()`` saves the boundary; ``summary()`` is the dictionary
    recorded in the artifact, over the whole run's history (also across resumes).
    """

    def __init__(
        self,
        student: LoadedModel,
        teacher: nn.Module | None,
        train_set: Dataset,
        val_set: Dataset | None,
        out: str | Path,
        config: FinetuneConfig,
        signals: StopSignals,
        on_step: StepCallback | None = None,
        progress: FinetuneProgress | None = None,
    ) -> None:
        self.student, self.teacher = student, teacher
        self.train_set = train_set
        self.val_set = spread_subset(val_set, config.val_images) if val_set is not None else None
        self.out, self.config, self.signals = Path(out), config, signals
        self.on_step = on_step
        self._progress = progress
        self.history: list[dict[str, Any]] = []  # one summary per epoch, the whole run
        self.saved: dict[int, Path] = {}  # checkpoints written by this process, by step
        self.updating = False  # the weights are changing: no whole state to save
        self.started = time.perf_counter()

    # ----------------------------------------------------------------------------------------
    # setup and resume

    def setup(self) -> Path | None:
        """Everything before the first step, in order: the checks (nothing written before
        them), the Accelerator, the loaders, the model, optimizer and loaders prepared, the
        schedule and the loss. Returns the checkpoint to resume from, if any."""
        resume_from = self._start()
        model = self.student.model
        if self.sharded:  # trained as shards; the caller's model gets the result at the end
            model = copy_model(model)
        model.train()
        if self.teacher is not None:
            self.teacher = self.teacher.to(self.accelerator.device).eval().requires_grad_(False)
        self.sampler, train_loader, val_loader = training_loaders(
            self.train_set, self.val_set, self.config
        )
        config = self.config
        self.lr = (
            config.lr
            if config.lr is not None
            else default_lr(config.batch_size, config.accum, self.accelerator.num_processes)
        )
        self.settings = trajectory_settings(config, self.lr, self.accelerator.num_processes)
        if self.sharded:
            self._setup_sharded(model, train_loader, val_loader)
        else:
            self._setup_replicated(model, train_loader, val_loader)
        self._schedule(len(self.train_loader))
        self._loss()
        self.metrics = MetricsLog(self.out / METRICS, self.main)
        self.buffer_names = {name for name, _ in self.raw_model.named_buffers()}
        self.progress = (
            self._progress if self._progress is not None and self.main else FinetuneProgress()
        )
        self.position = TrainPosition()  # where training starts (inside an epoch on resume)
        self.start_totals = EpochTotals()
        self._mark_boundary(self.position, self.start_totals)
        return resume_from

    def _start(self) -> Path | None:
        """The run directory and the checks on the data and the processes (one line each,
        nothing written before them), the Accelerator and the seed; the checkpoint to resume
        from, if any."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        config, out = self.config, self.out
        resume_from = prepare_run_directory(out, config.resume)
        check_data(self.student.model, self.train_set, self.val_set, config)  # nothing written
        self.accelerator = accelerator = Accelerator(
            gradient_accumulation_steps=config.accum, mixed_precision=config.amp or "no"
        )
        _check_distributed(accelerator)
        self.sharded = config.fsdp
        if self.sharded:
            _check_fsdp(accelerator, config)
        self.main = accelerator.is_main_process
        if self.main:
            out.mkdir(parents=True, exist_ok=True)
        # device_specific: each process draws different Gumbel/mixup noise; the sampler's seed
        # stays shared so the processes split one permutation.
        set_seed(config.seed, device_specific=True)
        return resume_from

    def _schedule(self, batches_per_epoch: int) -> None:
        """The run's length and its warm-up + cosine schedule. The scheduler is stepped here once
        per optimizer step rather than prepared: a prepared scheduler advances once per process
        per step, which would shorten the schedule under DDP."""
        length = RunLength.of(batches_per_epoch, self.config)
        self.steps_per_epoch, self.total_steps = length.steps_per_epoch, length.total_steps
        self.epochs = length.epochs
        warning = length.warning()
        if self.main and warning is not None:
            log.warning(warning)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        self.scheduler = build_scheduler(optimizer, length.total_steps, length.warmup_steps)

    def _loss(self) -> None:
        """The loss weights, mixup (where the config asks for it) and the loss."""
        config = self.config
        self.weights = LossWeights(
            config.ratio_weight, config.distill_weight, config.token_distill_weight
        )
        self.mixup_fn = None
        if config.mixup:
            from timm.data import Mixup

            self.mixup_fn = Mixup(**config.mixup)
        self.criterion = FinetuneLoss(
            self.taps,
            self.weights,
            mixup=self.mixup_fn is not None,
            smoothing=config.smoothing,
            task=config.task,
        )

    def _setup_replicated(
        self, model: nn.Module, train_loader: DataLoader, val_loader: DataLoader | None
    ) -> None:
        """DDP (or one process): Accelerate wraps the model; every process holds all of it."""
        accelerator, config = self.accelerator, self.config
        optimizer = build_optimizer(model, self.lr, config.weight_decay)
        # The EMA copy is made before the loss taps put hooks on the model (a deepcopy would
        # keep them).
        self.ema = None
        if config.ema_decay:
            from timm.utils import ModelEmaV3

            self.ema = ModelEmaV3(model, decay=config.ema_decay)
            self.ema.module.to(accelerator.device)
        # The taps go in before prepare: the token tap may add a node to the student's graph.
        self.taps = DistillationTaps(
            model, self.teacher, token_distill=config.token_distill_weight > 0
        )
        if val_loader is not None:
            model, optimizer, train_loader, val_loader = accelerator.prepare(
                model, optimizer, train_loader, val_loader
            )
        else:
            model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
        self.model, self.optimizer = model, optimizer
        self.train_loader, self.val_loader = train_loader, val_loader
        self.raw_model = accelerator.unwrap_model(model)

    def _setup_sharded(
        self, model: nn.Module, train_loader: DataLoader, val_loader: DataLoader | None
    ) -> None:
        """FSDP2: the model (a copy of the student) is sharded here, then the optimizer is built
        over the shards; Accelerate prepares only the optimizer and the loaders."""
        from vitcompress.training.sharding import shard_model

        accelerator, config = self.accelerator, self.config
        self.ema = None  # refused with --fsdp (_check_fsdp)
        self.taps = DistillationTaps(
            model, self.teacher, token_distill=config.token_distill_weight > 0
        )
        shard_model(model, accelerator.device)
        optimizer = build_optimizer(model, self.lr, config.weight_decay)
        loaders = [train_loader] + ([val_loader] if val_loader is not None else [])
        optimizer, *loaders = accelerator.prepare(optimizer, *loaders)
        self.model = self.raw_model = model
        self.optimizer = optimizer
        self.train_loader = loaders[0]
        self.val_loader = loaders[1] if val_loader is not None else None

    def resume(self, path: Path) -> None:
        """Continue from the checkpoint at ``path``: everything ``checkpoint()`` saved."""
        state = load_checkpoint(path)
        _check_same_settings(path, state.get("settings"), self.settings)
        if self.sharded:
            load_training_state(path, state, self.model, self.optimizer.optimizer, sharded=True)
        else:
            load_training_state(path, state, self.raw_model, self.optimizer, sharded=False)
        self.scheduler.load_state_dict(state["scheduler"])
        scaler = self.accelerator.scaler
        if state.get("scaler") is not None and scaler is not None:
            scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        rngs = state["rng"]
        set_rng_state(rngs[self.accelerator.process_index % len(rngs)])
        self.position = TrainPosition(state["epoch"], state["batches_done"], state["global_step"])
        # Checkpoints written before these two were kept start the summary afresh.
        self.start_totals = EpochTotals(**state.get("epoch_totals", {}))
        self.history = [dict(entry) for entry in state.get("history", [])]
        self._mark_boundary(self.position, self.start_totals)
        self.progress.note(
            f"resumed from step {self.position.global_step} (epoch {self.position.epoch + 1}) "
            f"of {self.out}"
        )

    # ----------------------------------------------------------------------------------------
    # the boundary and checkpoints

    def _buffers(self) -> dict[str, torch.Tensor]:
        # Forward passes in training mode may change buffers (batch-norm statistics) before the
        # step completes; a stop between batches saves them as they were at the last step.
        return {
            k: v.detach().clone()
            for k, v in self.raw_model.state_dict().items()
            if k in self.buffer_names
        }

    def _mark_boundary(self, position: TrainPosition, totals: EpochTotals) -> None:
        """Record a point where a whole state can be saved: after an optimizer step, at the
        start of an epoch, or after a resume."""
        self.boundary = TrainPosition(position.epoch, position.batches_done, position.global_step)
        self.boundary_rng = rng_state()
        self.boundary_buffers = self._buffers()
        self.boundary_totals = EpochTotals(**asdict(totals))
        self.updating = False

    def checkpoint_state(self, rngs: list[dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint holds (complete on the main process): the boundary's state, with
        the RNG states ``rngs`` of every process. Collective under --fsdp, where the whole
        model and optimizer state are gathered from the shards."""
        scaler = self.accelerator.scaler
        if self.sharded:
            model_state = full_model_state(self.model)
            optimizer_state = full_optimizer_state(self.model, self.optimizer.optimizer)
        else:
            model_state, optimizer_state = self.raw_model.state_dict(), self.optimizer.state_dict()
        return {
            "model": {**model_state, **self.boundary_buffers},
            "optimizer": optimizer_state,
            "sharding": SHARDED if self.sharded else None,
            "scheduler": self.scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "rng": rngs,
            "epoch": self.boundary.epoch,
            "batches_done": self.boundary.batches_done,
            "global_step": self.boundary.global_step,
            "epoch_totals": asdict(self.boundary_totals),
            "history": [dict(entry) for entry in self.history],
            "settings": self.settings,
        }

    def checkpoint(self) -> Path:
        """Save the boundary. Collective: every process calls it, only the first one writes."""
        from accelerate.utils import gather_object

        rngs = gather_object([self.boundary_rng])
        step = self.boundary.global_step
        path = self.out / CHECKPOINTS / checkpoint_name(step)
        state = self.checkpoint_state(rngs)
        if self.main:
            path = save_checkpoint(
                state, self.out / CHECKPOINTS, step, self.config.keep_checkpoints
            )
        self.accelerator.wait_for_everyone()
        self.saved[step] = path
        return path

    # ----------------------------------------------------------------------------------------
    # safe points

    def stop_agreed(self) -> bool:
        """A safe point: True when any process has a stop request (all processes call this at
        the same points, so they stop together and the collective save cannot hang)."""
        local = self.signals.requested
        if self.accelerator.num_processes == 1:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=self.accelerator.device)
        agreed = float(self.accelerator.reduce(flag, reduction="sum")) > 0
        if agreed and not local:
            self.signals.request("another process was signalled")
        return agreed

    def checked(self, batches: Any) -> Any:
        """``batches`` with a safe point after each fetch. A DataLoader worker killed by the
        same signal (Ctrl-C reaches the whole process group) counts as the stop request."""
        iterator = iter(batches)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception:
                if not self.signals.requested:
                    raise
                batch = None
            if self.stop_agreed():
                raise _StopAgreed
            yield batch

    # ----------------------------------------------------------------------------------------
    # training and evaluation

    def train_one_epoch(self, epoch: int) -> dict[str, Any]:
        """Train ``epoch`` from the current position to its end (or the run's last step);
        return its training summary (train loss, lr, images/s over the whole epoch)."""
        accelerator, config, model = self.accelerator, self.config, self.model
        self.sampler.start_epoch(epoch)
        resumed_here = epoch == self.position.epoch
        skip = self.position.batches_done if resumed_here else 0
        totals = EpochTotals(**asdict(self.start_totals)) if resumed_here else EpochTotals()
        loader = (
            accelerator.skip_first_batches(self.train_loader, skip) if skip else self.train_loader
        )
        batch_index = skip
        self.progress.start_epoch(epoch, skip // config.accum)
        window_images, window_start = 0, time.perf_counter()  # this step's, for the totals
        logged = RateWindow()  # since the last log line, for its images/s
        model.train()
        for images, labels in self.checked(loader):
            targets = labels
            if self.mixup_fn is not None:
                images, targets = self.mixup_fn(images, labels)
            loss, parts = self._train_batch(images, targets)
            batch_index += 1
            totals.loss_sum += float(loss.detach())
            totals.batches += 1
            window_images += images.shape[0] * accelerator.num_processes
            logged.add(images.shape[0] * accelerator.num_processes)
            if not accelerator.sync_gradients:
                continue
            if not accelerator.optimizer_step_was_skipped:
                self.scheduler.step()
            step = self.boundary.global_step + 1
            if self.ema is not None:
                self.ema.update(self.raw_model, step=step)
            elapsed = time.perf_counter() - window_start
            totals.images += window_images
            totals.seconds += elapsed
            self._mark_boundary(TrainPosition(epoch, batch_index, step), totals)
            record = {
                "type": "step",
                "epoch": epoch,
                "step": step,
                "loss": float(loss.detach()),
                **parts,
                "lr": self.optimizer.param_groups[0]["lr"],
                "img_per_s": logged.rate(),
            }
            if step % max(1, config.log_every) == 0 or step == 1:
                self.metrics.write(record)
                logged.restart()
            window_images, window_start = 0, time.perf_counter()
            self.progress.step(record)
            if config.save_every and step % config.save_every == 0:
                self.checkpoint()
            if self.on_step is not None:
                self.on_step(step, self.raw_model)
            if self.stop_agreed():
                raise _StopAgreed
            if step >= self.total_steps:  # --max-steps ends this epoch early
                break
        totals = self.boundary_totals
        return {
            "type": "epoch",
            "epoch": epoch,
            "step": self.boundary.global_step,
            "train_loss": totals.loss_sum / max(1, totals.batches),
            "lr": self.optimizer.param_groups[0]["lr"],
            "img_per_s": totals.images / totals.seconds if totals.seconds > 0 else None,
        }

    def _train_batch(
        self, images: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One batch: the forward (the teacher's too, where a distillation term reads it), the
        loss (refused when not finite) and its backward; the optimizer steps where the
        accumulation completes. Returns the loss and its parts."""
        accelerator, model = self.accelerator, self.model
        with accelerator.accumulate(model):
            self.taps.reset()
            with accelerator.autocast():
                logits = unwrap_logits(model(images))
                teacher_logits = None
                if self.teacher is not None and (self.weights.distill or self.taps.token_distill):
                    with torch.no_grad():
                        teacher_logits = unwrap_logits(self.teacher(images))
            loss, parts = self.criterion(logits, targets, teacher_logits)
            _check_finite(loss, accelerator, self.boundary.global_step + 1)
            accelerator.backward(loss)
            self.updating = accelerator.sync_gradients  # the weights change from here on
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss, parts

    def evaluate(self) -> dict[str, float]:
        """Validation top-1 of the model (and of its EMA, ``val_top1_ema``); empty without
        validation data. For segmentation, the mean IoU (``val_miou``, ``val_miou_ema``)."""
        if self.val_loader is None:
            return {}
        assert self.val_set is not None
        models = {"": self.model}
        if self.ema is not None:
            models["_ema"] = self.ema.module
        return validation_metrics(
            models, self.accelerator, self.val_set, lambda: self.checked(self.val_loader),
            self.config, self.signals, self.progress.evaluation,
        )  # fmt: skip

    def end_epoch(self, summary: dict[str, Any]) -> None:
        """Evaluate, record the epoch and checkpoint the start of the next one."""
        epoch = summary["epoch"]
        if self.val_loader is not None and self.boundary.global_step not in self.saved:
            self.checkpoint()  # the epoch's training, kept where validation fails (a bad image)
        try:
            summary.update(self.evaluate())
        except UserError as e:
            step = self.boundary.global_step
            raise FinetuneError(
                f"{e}; the training up to step {step} is saved in {self.saved[step]}: "
                "continue with --resume"
            ) from e
        self.metrics.write(summary)
        # An epoch cut by --max-steps and continued by a longer run is reported once, whole.
        self.history = [h for h in self.history if h["epoch"] != epoch] + [summary]
        self.progress.epoch_done(summary)
        if self.boundary.batches_done == len(self.train_loader):
            self._mark_boundary(
                TrainPosition(epoch + 1, 0, self.boundary.global_step), EpochTotals()
            )
        else:  # cut by --max-steps: a longer run continues inside this epoch
            self._mark_boundary(self.boundary, self.boundary_totals)
        self.checkpoint()

    def train(self) -> None:
        """Every epoch from the current position; an interrupt becomes FinetuneInterrupted."""
        self.progress.start(self.epochs, self.steps_per_epoch, total_steps=self.total_steps)
        try:
            for epoch in range(self.position.epoch, self.epochs):
                if self.boundary.global_step >= self.total_steps:  # resumed at the run's end
                    break
                self.end_epoch(self.train_one_epoch(epoch))
        except (_StopAgreed, KeyboardInterrupt) as stop:
            self.progress.stop()  # before the message, which a live bar would draw over
            raise self._interrupted(stop) from None
        except BaseException:
            self.progress.stop()
            raise
        self.progress.stop()

    def _interrupted(self, stop: BaseException) -> FinetuneInterrupted:
        """Save where the last optimizer step left things (the batches of an unfinished
        accumulation are redone on resume). Not after a forced stop or during an update, whose
        state could be torn, and not after a KeyboardInterrupt raised on one process only,
        whose collective save could hang."""
        signals = self.signals
        reason = signals.received or "KeyboardInterrupt"
        step = self.boundary.global_step
        if (
            isinstance(stop, ForcedStop)
            or self.updating
            or (not isinstance(stop, _StopAgreed) and self.accelerator.num_processes > 1)
        ):
            text = f"{reason}, stopped at once" if signals.forced else reason
            return FinetuneInterrupted(text, step, None, find_latest(self.out / CHECKPOINTS))
        try:
            path = self.saved.get(step) or self.checkpoint()
        except ForcedStop:
            text = f"{reason}, stopped at once while saving"
            return FinetuneInterrupted(text, step, None, find_latest(self.out / CHECKPOINTS))
        return FinetuneInterrupted(reason, step, path)

    # ----------------------------------------------------------------------------------------
    # the end

    def summary(self) -> dict[str, Any]:
        """The run's summary as the artifact records it (:func:`run_summary`)."""
        return run_summary(
            self.config,
            epochs=self.epochs,
            steps=self.boundary.global_step,
            lr=self.lr,
            processes=self.accelerator.num_processes,
            sharded=self.sharded,
            loss_weights=asdict(self.weights),
            history=self.history,
            started=self.started,
        )

    def write_artifacts(self, result: dict[str, Any]) -> None:
        """The fine-tuned artifact (and the EMA's) in ``out``, from the main process."""
        accelerator, student = self.accelerator, self.student
        trained = self.raw_model
        if self.sharded:  # the whole weights, gathered from the shards into the caller's model
            trained = student.model
            trained.load_state_dict(full_model_state(self.model, everywhere=True))
        accelerator.wait_for_everyone()
        if self.main:
            ema = self.ema.module if self.ema is not None else None
            write_run_artifacts(self.out, trained, ema, student.source, student.input_size, result)
        accelerator.wait_for_everyone()

    def _write_start_record(self, resume_from: Path | None) -> None:
        """One ``start`` line per invocation, so the metrics log names what the numbers after it
        were measured on (the data config among them) and where a resumed run picked up."""
        step = self.position.global_step
        dropped = self.metrics.forget_after(step) if resume_from is not None else None
        self.metrics.write(start_record(step, resume_from, dropped, self.config.extra))

    def run(self) -> dict[str, Any]:
        """Set up, resume if asked, train, write the artifact; return the summary."""
        resume_from = self.setup()
        try:
            if resume_from is not None:
                self.resume(resume_from)
            self._write_start_record(resume_from)
            self.train()
        finally:
            self.taps.remove()
        result = self.summary()
        self.write_artifacts(result)
        result["out"] = str(self.out)
        result["checkpoints"] = [str(p) for p in list_checkpoints(self.out / CHECKPOINTS)]
        return result
