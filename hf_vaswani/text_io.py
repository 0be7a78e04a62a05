"""The text of the command line's input and output: sentences read one per line, results written one per line.

Only "\\n" ends a line: output line i belongs to input line i, whatever characters a sentence or a translation holds.
"""

from collections.abc import Iterable, Sequence
from typing import BinaryIO, TextIO

from .model.errors_vaswani import UsageError

# Characters that str.splitlines (and so text-mode readers and most viewers) treat as line ends. Only "\n" ends a line
# of a translation file; any other one inside a translation would make one input line two output lines.
LINE_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
LINE_BREAKS_TO_SPACES = str.maketrans(dict.fromkeys("\n" + LINE_BREAKS, " "))


def read_sentences(source: BinaryIO, name: str) -> list[str]:
    """The lines of UTF-8 text, split at "\\n" only (and a "\\r" just before it), without their line ends; a
    byte-order mark that some editors write at the start is dropped, as Python's "utf-8-sig" codec drops it.

    Text-mode reading and str.splitlines also split at a lone "\\r", "\\x0c", "\\u2028" and more, which inside a
    sentence would make one input line two translations.
    """
    try:
        text = source.read().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UsageError(f"{name} is not UTF-8 text: {error}") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the line end of the last line, or an empty input: no line after it
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def as_one_line(text: str) -> str:
    """`text` with every character that some reader takes for a line end replaced by a space."""
    return text.translate(LINE_BREAKS_TO_SPACES)


class PipeClosed(Exception):
    """The reader of the output closed its end of the pipe (`vaswani translate ... | head -1`): nothing is wrong, no
    one reads the rest."""


def print_lines(lines: Iterable[str], target: TextIO) -> None:
    """Stream one line per item to `target`, each made one line (`as_one_line`); `files.write_lines` for a file.

    A pipe whose reader has gone raises `PipeClosed`; `target` is flushed here, so that a closed pipe shows at this
    call rather than at the interpreter's exit.
    """
    try:
        target.writelines(as_one_line(line) + "\n" for line in lines)
        target.flush()
    except BrokenPipeError as error:
        raise PipeClosed from error


def alignment_text(alignment: Sequence[tuple[int, int]]) -> str:
    """Moses/fast_align's form: "i-j" pairs of 0-based source word i and target word j, separated by spaces."""
    return " ".join(f"{source}-{target}" for source, target in alignment)
