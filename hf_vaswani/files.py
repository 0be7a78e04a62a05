"""Writing outputs whole or not at all, and checking output paths before any work.

Every writer builds its output under a temporary name beside the final one (`partial_path`: hidden, same folder, so
the final rename stays on one file system) and renames it into place only when complete: a failure (disk full, an
error, an interrupt) leaves the earlier output as it was and no partial one beside it.
"""

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .model.errors_vaswani import UsageError
from .text_io import print_lines


def partial_path(path: Path) -> Path:
    """The temporary name `path` is written under before it is renamed into place (per process, so ranks differ)."""
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def replace_file(path: Path, write: Callable[[Path], object]) -> Path:
    """Let `write` create a temporary file beside `path`, then rename it over `path`.

    The temporary name does not end in `path`'s suffix, so a writer that picks its format by the name must be told it.
    """
    temporary = partial_path(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """`text` as UTF-8 into `path`, whole or not at all."""
    return replace_file(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_lines(lines: Iterable[str], path: Path) -> Path:
    """`print_lines` into `path` (UTF-8, "\\n" line ends), whole or not at all."""

    def write(temporary: Path) -> None:
        with open(temporary, "w", encoding="utf-8", newline="\n") as target:
            print_lines(lines, target)

    return replace_file(path, write)


def replace_folder(folder: Path, write: Callable[[Path], object]) -> Path:
    """Let `write` create and fill a temporary folder beside `folder`, then swap it in for `folder`.

    A directory cannot be renamed over a non-empty one, so the old folder steps aside for the two renames in between.
    """
    temporary = partial_path(folder)
    shutil.rmtree(temporary, ignore_errors=True)  # left by a killed process that had this process id
    try:
        write(temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    previous = folder.with_name(f".{folder.name}.{os.getpid()}.previous")
    if folder.exists():
        os.replace(folder, previous)
    os.replace(temporary, folder)
    shutil.rmtree(previous, ignore_errors=True)
    return folder


def copy_missing_entries(source: Path, destination: Path) -> None:
    """Copy into `destination` each file or folder of `source` it lacks: a folder written anew keeps what the writer
    did not write itself (a shortlist built later, a user's notes)."""
    if not source.is_dir():
        return
    for entry in source.iterdir():
        if not (destination / entry.name).exists():
            if entry.is_dir():
                shutil.copytree(entry, destination / entry.name)
            else:
                shutil.copy2(entry, destination / entry.name)


@contextlib.contextmanager
def new_folder(path: Path, option: str) -> Iterator[Path]:
    """An empty temporary folder beside `path`, renamed to `path` when the block completes and removed when it fails.

    An existing `path` is refused (ValueError, naming `option`) rather than mixed into.
    """
    if path.exists():
        raise UsageError(f"{option} {path} already exists; choose a new folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = partial_path(path)
    shutil.rmtree(temporary, ignore_errors=True)  # left by a killed process that had this process id
    temporary.mkdir()
    try:
        yield temporary
        temporary.rename(path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def check_input_file(path: Path, option: str) -> None:
    """Refuse a missing input file before any work (a directory is not a file either)."""
    if not path.is_file():
        raise UsageError(f"{option} {path}: {'a directory, not a file' if path.is_dir() else 'no such file'}")


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file that could not be written, before any work: writing comes last."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory, not a file")
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{option} {path}: {path.parent} is a file, not a directory")
    if not path.parent.is_dir():
        raise UsageError(f"{option} {path}: no directory {path.parent}")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{option} {path}: the directory {path.parent} is not writable")
