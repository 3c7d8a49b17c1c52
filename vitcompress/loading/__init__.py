"""Turn a ``--model SPEC`` (plus options) into an ``nn.Module``.

A spec is one of:

* a timm model name (``deit_small_patch16_224``), including the names ``vitcompress.zoo`` adds to
  timm's registry and timm's own ``hf-hub:`` / ``local-dir:`` prefixes;
* ``path/to/file.py:factory`` -- a Python file of the user's, imported by path;
* ``package.module:factory`` -- an importable module;
* a HuggingFace ``save_pretrained`` directory (``config.json`` and its weights, or their shards).

A directory holding ``vitcompress.json`` is a compressed model: ``vitcompress.api.load_model``
loads every kind of spec, this package only the base models it is built from.

Every failure the user can cause is raised as :class:`ModelLoadError` with a one-line message; the
CLI prints it and exits with status 2 instead of showing a traceback.

Modules: ``spec`` (what a spec names, importing files and modules), ``timm_hub`` (timm and the
Hugging Face hub), ``checkpoint`` (weights files), ``input_size``, ``source`` (``ModelSource``,
``LoadedModel``), ``errors``, ``hf`` (a HuggingFace ``save_pretrained`` directory), ``shards``
(a sharded directory's index and its shards), ``inferred_size`` and ``load``
(``load_base_model``, which uses them all).
"""

from vitcompress.loading.checkpoint import load_checkpoint
from vitcompress.loading.errors import ModelInputError, ModelLoadError, one_line
from vitcompress.loading.input_size import default_input_size
from vitcompress.loading.load import load_base_model
from vitcompress.loading.source import LoadedModel, ModelSource
from vitcompress.loading.spec import ARTIFACT_MARKER, is_artifact_directory

__all__ = [
    "ARTIFACT_MARKER",
    "LoadedModel",
    "ModelInputError",
    "ModelLoadError",
    "ModelSource",
    "default_input_size",
    "is_artifact_directory",
    "load_checkpoint",
    "load_base_model",
    "one_line",
]
