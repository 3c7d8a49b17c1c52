"""Where a command writes: ``--out`` and the other output options, checked when the command line
is read (before any work) to be writable, and never to be one of the command's own inputs."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from vitcompress.errors import UserError

# What a plot may be written as: formats matplotlib writes without extra packages.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


class OutputError(UserError):
    """An output path that cannot be written."""


class OutputOption(click.Option):
    """An option naming where the command writes (:func:`output_option` makes them), so that
    :func:`check_outputs_are_not_inputs` can tell outputs from inputs; ``suffixes``: the names
    the file may end in (:func:`check_output_suffixes`)."""

    def __init__(self, *args: Any, suffixes: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.suffixes = suffixes


def output_option(
    *names: str,
    folder: bool,
    help: str,
    required: bool = False,
    metavar: str | None = None,
    replaced: bool = False,
    suffixes: tuple[str, ...] = (),
) -> Callable:
    """An option naming where a command writes (a folder, or a file with ``folder=False``),
    checked to be writable when the command line is read: before any work, not after it.
    ``replaced``: the folder is written beside itself and renamed into place (an artifact), so
    the folder above it must be writable too. ``suffixes``: the file's name must end in one of
    them (a plot's format is its suffix: without one, matplotlib would write NAME.png)."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            check_writable(value, folder=folder, option=param.opts[0], replaced=replaced)
        elif required:  # some click releases skip `required` where a default of None is set
            raise click.MissingParameter(ctx=ctx, param=param)
        return value

    return click.option(
        *names,
        cls=OutputOption,
        type=click.Path(),  # the kind is checked by check_writable, in one line
        required=required,
        metavar=metavar,
        callback=check,
        help=help,
        suffixes=suffixes,
    )


def check_writable(
    path: str | os.PathLike[str], folder: bool, option: str = "--out", replaced: bool = False
) -> None:
    """Raise :class:`OutputError` unless ``path`` (a folder or a file) can be created or replaced:
    it is of the right kind if it exists, its name is one the file system takes, and the nearest
    existing folder above it is writable (with ``replaced``, the folder above an existing
    ``path`` too: it is written beside it and renamed into place)."""
    if str(path) == "":  # Path("") is ".", the folder the command runs in
        raise OutputError(f"{option} is empty; name a {'folder' if folder else 'file'}")
    target = Path(path).expanduser()
    kind = "folder" if folder else "file"
    try:
        exists = target.exists()
    except OSError as e:  # a name too long for the file system, a loop of links
        raise OutputError(f"{option} {path}: {e.strerror or e}") from None
    if exists and target.is_dir() != folder:
        found = "a directory" if target.is_dir() else "a file"
        raise OutputError(f"{option} {path} is {found}, not a {kind}")
    existing = target if folder and target.is_dir() else target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{option} {path}: {existing} is a file, not a folder")
    _check_name_lengths(target, existing, option, path)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: cannot write into {existing} (permission denied)")
    above = target.resolve().parent
    if replaced and exists and not os.access(above, os.W_OK | os.X_OK):
        raise OutputError(
            f"{option} {path}: cannot replace it: {above} is not writable (permission denied)"
        )


def _check_name_lengths(target: Path, existing: Path, option: str, path: Any) -> None:
    """Each name still to be made below ``existing`` fits the file system's limit; otherwise
    the write would fail after the work, not before it."""
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or no limit known
        return
    for part in target.parts:
        if len(os.fsencode(part)) > limit:
            raise OutputError(f"{option} {path}: {os.strerror(errno.ENAMETOOLONG)}")


# A directory holding one of these is a model (a compressed model's, a HuggingFace
# save_pretrained one's) ...
_MODEL_DIRECTORY_MARKERS = ("vitcompress.json", "config.json")
# ... made of these files (paths inside it; a fine-tuning run's too): an output replacing one
# would replace part of the model. Other files in it (an ONNX export beside it) are outputs.
_MODEL_FILES = ("*.json", "*.jsonl", "*.safetensors", "*.bin", "checkpoints/*", "ema/*")


def check_outputs_are_not_inputs(ctx: click.Context) -> None:
    """Refuse, in one line, an output file that the command also reads: a file named by another
    option or argument (``visualize --image``, ``export --checkpoint``, a ``file.py:factory``,
    ``report``'s runs), or a file inside a model directory given as input. Writing it would
    replace what the command reads, and the user's file would be lost."""
    outputs = [
        (param, Path(value).expanduser())
        for param in ctx.command.params
        if isinstance(param, OutputOption) and (value := ctx.params.get(param.name or ""))
    ]
    outputs = [(param, path) for param, path in outputs if path.is_file()]
    if not outputs:
        return
    for param in ctx.command.params:
        if isinstance(param, OutputOption):
            continue
        for given, value in _path_candidates(ctx.params.get(param.name or "")):
            for output_param, output in outputs:
                if _replaces(output, value):
                    where = f" ({param.opts[0]} {given})" if isinstance(param, click.Option) else ""
                    raise OutputError(
                        f"{output_param.opts[0]} {output} would replace "
                        f"{'a file of ' if value.is_dir() else ''}{value}{where}, which the "
                        "command reads; write to another path"
                    )


def check_output_suffixes(ctx: click.Context) -> None:
    """Refuse, in one line, an output file whose name does not end in a suffix its option
    takes: a plot's format is its suffix (matplotlib writes ``NAME`` as ``NAME.png``, and a
    suffix it does not know fails after the work is done)."""
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param, OutputOption) and param.suffixes and value:
            if Path(value).suffix.lower() not in param.suffixes:
                stem = Path(value).stem or "plot"
                raise OutputError(
                    f"{param.opts[0]} {value}: name the file with its format, "
                    f"{' or '.join(param.suffixes)} (e.g. {stem}{param.suffixes[0]})"
                )


def _path_candidates(value: Any) -> Iterator[tuple[str, Path]]:
    """``(value, path)`` for each existing path an option's value names: the value itself, or the
    file of a ``path/to/file.py:factory`` spec; each item of a repeated option or argument."""
    if isinstance(value, tuple | list):
        for item in value:
            yield from _path_candidates(item)
        return
    if not isinstance(value, str) or not value:
        return
    texts = [value]
    if ":" in value:
        texts.append(value.rsplit(":", 1)[0])
    for text in texts:
        try:
            path = Path(text).expanduser()
            if path.exists():
                yield value, path
        except (OSError, ValueError):  # not a path at all (too long, a NUL byte)
            continue


def _replaces(output: Path, value: Path) -> bool:
    """Writing ``output`` (an existing file) replaces ``value``, or one of the files a model
    directory ``value`` is made of."""
    try:
        if value.is_file():
            return os.path.samefile(output, value)
        if value.is_dir() and any(
            (value / marker).is_file() for marker in _MODEL_DIRECTORY_MARKERS
        ):
            directory, resolved = value.resolve(), output.resolve()
            if directory not in resolved.parents:
                return False
            inside = resolved.relative_to(directory)
            return any(inside.match(pattern) for pattern in _MODEL_FILES)
    except OSError:
        return False
    return False
