"""scripts/prepare_multi30k.py: the multi30k/dataset preprocessing (lowercase, normalize punctuation, Moses-tokenize)
that Wu et al. (2021) trained on, checked against sacremoses called directly and against lines of their data."""

import gzip
import subprocess
import sys
from pathlib import Path

from sacremoses import MosesPunctNormalizer, MosesTokenizer

SCRIPT = Path(__file__).parents[2] / "scripts" / "prepare_multi30k.py"
SPLITS = ("train", "val", "test_2016_flickr")

# Multi30k training lines and the same lines in LividWo/Revisit-MMT's data/multi30k-en-de (train.bert.en; train.de
# with its BPE's "@@ " removed): escaping, quotes normalized („ “ and ’ become &quot;), a sentence-final `."` of German
# text turned into `" .` while the English one keeps `. "`, and no split of "-zeichen".
PUBLISHED = {
    "en": [
        (
            'A woman and her daughter measuring themselves against a giant ruler at "Washington Farms".',
            "a woman and her daughter measuring themselves against a giant ruler at &quot; washington farms . &quot;",
        ),
    ],
    "de": [
        (
            "Ein Mann und eine Frau halten ein Schild mit der Aufschrift: „It's a nice day for a Gay Wedding.“",
            "ein mann und eine frau halten ein schild mit der aufschrift : &quot; it &apos; s a nice day for a gay "
            "wedding &quot; .",
        ),
        (
            "Ein Mann mit gelber Krawatte und Hemd macht das „Hook ’em Horns“-Zeichen. ",
            "ein mann mit gelber krawatte und hemd macht das &quot; hook &quot; em horns &quot; -zeichen .",
        ),
        (
            '"Zwei männliche und eine weibliche Person spielen in einer \tWasserfontäne."',
            "&quot; zwei männliche und eine weibliche person spielen in einer wasserfontäne &quot; .",
        ),
    ],
}

MADE_UP = {
    "en": ["Two Dogs play in the snow-covered park.", 'A man says "Hello."', "It's Mr. Smith's black-and-white cat!"],
    "de": ["Zwei Hunde spielen im schneebedeckten Park.", "Ein Mann sagt „Hallo.“", "Das ist Herrn Müllers T-Shirt!"],
}


def write_corpus(folder: Path, lines: dict[str, list[str]]) -> None:
    folder.mkdir()
    for split in SPLITS:
        for lang, sentences in lines.items():
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.writelines(sentence + "\n" for sentence in sentences)


def prepare(data_dir: Path, output_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(data_dir), str(output_dir)], capture_output=True, text=True, timeout=120
    )


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()


def test_prepared_files_are_sacremoses_lowercase_normalize_tokenize(tmp_path: Path) -> None:
    write_corpus(tmp_path / "raw", MADE_UP)
    result = prepare(tmp_path / "raw", tmp_path / "prepared")
    assert result.returncode == 0, result.stderr
    for lang, sentences in MADE_UP.items():
        normalizer, tokenizer = MosesPunctNormalizer(lang=lang, perl_parity=True), MosesTokenizer(lang=lang)
        expected = [
            tokenizer.tokenize(
                normalizer.normalize(sentence.lower() + "\n"),
                return_str=True,
                escape=True,
                aggressive_dash_splits=False,
            )
            for sentence in sentences
        ]
        for split in SPLITS:
            assert read_lines(tmp_path / "prepared" / f"{split}.{lang}.gz") == expected
    # what the expectation above is made of: lowercased, escaped, hyphenated words kept whole
    assert read_lines(tmp_path / "prepared" / "train.en.gz")[2] == "it &apos;s mr. smith &apos;s black-and-white cat !"


def test_published_lines_come_out_as_in_the_published_data(tmp_path: Path) -> None:
    write_corpus(tmp_path / "raw", {lang: [raw for raw, _ in pairs] for lang, pairs in PUBLISHED.items()})
    result = prepare(tmp_path / "raw", tmp_path / "prepared")
    assert result.returncode == 0, result.stderr
    for lang, pairs in PUBLISHED.items():
        assert read_lines(tmp_path / "prepared" / f"train.{lang}.gz") == [published for _, published in pairs]


def test_a_missing_file_is_one_error_line_naming_it(tmp_path: Path) -> None:
    write_corpus(tmp_path / "raw", MADE_UP)
    (tmp_path / "raw" / "val.de.gz").unlink()
    result = prepare(tmp_path / "raw", tmp_path / "prepared")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"prepare_multi30k.py: error: {tmp_path / 'raw' / 'val.de.gz'}: no such file"
    ]
    assert not (tmp_path / "prepared").exists()
