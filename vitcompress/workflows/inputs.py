"""What a command was asked to work on, one object each: the model (``--model`` and its four
options), a second model (``eval --base``) and the data (``--data`` and the data config options);
and loading them, so that every command reads the same options the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitcompress.api import load_model
from vitcompress.artifacts.base import load_artifact_base
from vitcompress.compilation.metadata import compression_info
from vitcompress.data import DataConfig, model_dataset
from vitcompress.loading import LoadedModel, ModelLoadError, is_artifact_directory

# ``eval --base source``: the base a compressed --model records.
BASE_FROM_ARTIFACT = "source"


@dataclass(frozen=True)
class ModelRequest:
    """``--model SPEC`` with ``--model-arg``, ``--checkpoint``, ``--pretrained``, ``--input-size``,
    ``--entry``.

    ``args`` are the parsed model arguments; ``typed_args`` the ``key=value`` texts as given,
    which is what a search cache records.
    """

    spec: str
    args: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    pretrained: bool = False
    input_size: tuple[int, ...] | None = None
    typed_args: tuple[str, ...] = ()
    entry: str = "forward"  # ``--entry``: the base's method run (and compressed) as the model

    def load(self) -> LoadedModel:
        return load_model(
            self.spec,
            self.args,
            checkpoint=self.checkpoint,
            pretrained=self.pretrained,
            input_size=self.input_size,
            entry=self.entry,
        )

    @property
    def is_artifact(self) -> bool:
        """The spec is a compressed model directory."""
        return is_artifact_directory(self.spec)


@dataclass(frozen=True)
class PlanRequest:
    """The plan options: ``--variant``, ``--keep`` (ratios, or a cumulative or per-block form),
    ``--locs`` and ``--policy``; ``given``: the user set one of them (a compressed ``--model``,
    which keeps its own plan, then ignores them with a warning)."""

    variant: Any  # the method: its registered name, or the object made with its settings
    keep: Any = None
    locs: list[int] | None = None
    policy: str = "score"
    given: bool = False

    @property
    def variant_name(self) -> str:
        return str(getattr(self.variant, "name", self.variant))


@dataclass(frozen=True)
class BaseRequest:
    """``--base SPEC`` with ``--base-model-arg``, ``--base-checkpoint``, ``--base-pretrained``;
    ``given`` names those of the three that were passed (for refusals)."""

    spec: str
    args: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    pretrained: bool = False
    given: tuple[str, ...] = ()

    @property
    def from_artifact(self) -> bool:
        return self.spec == BASE_FROM_ARTIFACT


def load_base(base: BaseRequest, model: LoadedModel) -> LoadedModel:
    """The ``--base`` model, at ``model``'s input size. ``--base source`` rebuilds the base a
    compressed ``model`` records (spec, model arguments and base weights)."""
    given = ", ".join(base.given)
    if given and is_artifact_directory(base.spec):
        raise ModelLoadError(
            f"--base {base.spec} is a compressed model that fixes its architecture and weights; "
            f"drop {given}"
        )
    if not base.from_artifact:
        request = ModelRequest(
            base.spec, base.args, base.checkpoint, base.pretrained, model.input_size
        )
        return request.load()
    if given:
        raise ModelLoadError(
            f"--base {BASE_FROM_ARTIFACT} takes the base's arguments and weights from the "
            f"artifact; drop {given}"
        )
    info = compression_info(model.model)
    if info is None or info.artifact is None:
        raise ModelLoadError(
            f"--base {BASE_FROM_ARTIFACT} needs --model to be a compressed model directory"
        )
    return load_artifact_base(info.artifact, model.input_size)


@dataclass(frozen=True)
class DataRequest:
    """``--data`` (a folder with train/ and val/, or ``fashion-mnist``), ``--data-dir``, the
    split a command reads, and ``overrides``: ``--mean``/``--std``/``--interpolation``/
    ``--crop-pct``, parsed (``vitcompress.data.config.data_overrides``)."""

    source: str | None
    data_dir: str | None = None
    split: str = "val"
    overrides: dict[str, Any] = field(default_factory=dict)

    def for_model(
        self, model: nn.Module, input_size: tuple[int, ...]
    ) -> tuple[Dataset, DataConfig]:
        """The split without augmentation, brought to ``model`` as it expects its images, and
        the config resolved for it."""
        assert self.source is not None  # the commands require --data
        return model_dataset(
            model, self.source, self.split, input_size, self.data_dir, self.overrides
        )
