"""FSDP2 for fine-tuning: shard a model with torch's ``fully_shard`` over every process, and
move whole (unsharded) state dicts in and out of it for checkpoints and the artifact.

Accelerate selects its FSDP plugin only on GPU-like devices (on CPU it keeps DDP), so the run
shards the model itself, on any backend (gloo on CPU, NCCL on GPUs). Each process then holds one
shard of every parameter (a DTensor) and of its optimizer state; a checkpoint or the artifact is
written from the full tensors gathered from all of them, never from one process's shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from vitcompress.training.checkpoint import check_weights
from vitcompress.training.run_directory import FinetuneError

SHARDED = "fsdp2"  # a checkpoint's "sharding" entry; its optimizer state is keyed by name


def check_sharding(path: Path, state: dict[str, Any], sharded: bool) -> None:
    """Refuse resuming a checkpoint with other sharding than it was written with: the
    optimizer state of a sharded run is keyed by name, a replicated run's by index."""
    written_sharded = state.get("sharding") == SHARDED
    if written_sharded != sharded:
        needed = "with" if written_sharded else "without"
        raise FinetuneError(
            f"{path} was written by a run {needed} --fsdp; resume it {needed} --fsdp"
        )


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Shard ``model`` (moved to ``device``) over every process of the default group, in place.

    The first process's weights are broadcast first, as DDP does: each process contributes its
    own slice of every tensor, so copies that differ would mix into a model nobody had.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.to(device)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local_and_global_sizes(model: nn.Module) -> tuple[int, int]:
    """Elements this process holds of the model's parameters, and the model's total."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for parameter in model.parameters():
        total += parameter.numel()
        held += (
            parameter.to_local().numel() if isinstance(parameter, DTensor) else parameter.numel()
        )
    return held, total


def full_model_state(model: nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU, gathered from every shard (collective). Only the first
    process gets it unless ``everywhere``; the others get an empty dict."""
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    )
    if everywhere:
        state = {k: v.detach().cpu() for k, v in state.items()}
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, on the first process (collective)."""
    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_training_state(
    path: Path, state: dict[str, Any], model: nn.Module, optimizer: Any, sharded: bool
) -> None:
    """A checkpoint's model and optimizer state into the run's: into the shards under --fsdp
    (``model`` the sharded model, ``optimizer`` its inner optimizer), else into the whole model,
    once it is checked to hold this model's weights. Each refusal is one line."""
    check_sharding(path, state, sharded)
    if sharded:
        load_full_state(model, optimizer, state["model"], state["optimizer"])
        return
    check_weights(path, state["model"], model.state_dict())
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> None:
    """Put whole state dicts (every process read the same checkpoint) into the shards."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
