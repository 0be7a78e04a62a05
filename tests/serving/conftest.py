"""What the serving tests compare with: `vaswani translate`'s output for probe sentences, run as its users run it."""

from dataclasses import dataclass

import pytest
from tiny import PROBE_SENTENCES

from hf_vaswani.cli import main


@dataclass(frozen=True)
class Reference:
    """`sentences`, their translations (`best`) and their n-best lists of `nbest_size`, by `vaswani translate`."""

    sentences: list[str]
    best: list[str]
    nbest: list[list[str]]
    nbest_size: int = 3


@pytest.fixture(scope="session")
def reference(trained_folder, tmp_path_factory) -> Reference:
    folder = tmp_path_factory.mktemp("command")
    sentences = PROBE_SENTENCES[:24]
    source = folder / "source.txt"
    source.write_text("\n".join(sentences) + "\n")
    command = ["translate", str(trained_folder), "--input", str(source), "--output"]
    main([*command, str(folder / "best.txt")])
    main([*command, str(folder / "nbest.txt"), "--nbest", str(Reference.nbest_size)])
    nbest: list[list[str]] = [[] for _ in sentences]
    for line in (folder / "nbest.txt").read_text().splitlines():  # i ||| hypothesis ||| LogProb= ... ||| score
        number, text, *_ = line.split(" ||| ")
        nbest[int(number)].append(text)
    return Reference(sentences, (folder / "best.txt").read_text().splitlines(), nbest)
