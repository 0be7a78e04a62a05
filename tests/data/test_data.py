"""Tests of hf_vaswani.data.corpus: local parallel files and Hub translation datasets."""

import gzip
import json
import re
from pathlib import Path

import datasets
import pytest

from hf_vaswani.data.corpus import (
    FEATURES,
    load_corpus,
    load_hub_translation,
    load_jsonl,
    load_parallel_files,
    load_tsv,
)

# ----------------------------------------------------------------------------------------------------------------------
# Local files
# ----------------------------------------------------------------------------------------------------------------------

SOURCES = ["The man sees the dog.", "Ich weiß, dass er kommt.", "Straße und Mädchen: schön!"]
TARGETS = ["Der Mann sieht den Hund.", "I know that he comes.", "Street and girl: beautiful!"]
TSV_LINES = [f"{source}\t{target}" for source, target in zip(SOURCES, TARGETS, strict=True)]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _lines(values: list[str], newline: str = "\n") -> bytes:
    return newline.join(values).encode() + newline.encode()


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_parallel_files_round_trip(tmp_path, suffix):
    source = _write(tmp_path / f"train.en{suffix}", _lines(SOURCES))
    # CRLF line ends and no final newline are both fine.
    target = _write(tmp_path / f"train.de{suffix}", "\r\n".join(TARGETS).encode())
    ds = load_parallel_files(source, target)
    assert ds.features == FEATURES
    assert ds["source"] == SOURCES and ds["target"] == TARGETS


def test_gzip_is_detected_by_magic_bytes(tmp_path):
    source = tmp_path / "train.src"
    source.write_bytes(gzip.compress(_lines(SOURCES)))
    target = _write(tmp_path / "train.tgt", _lines(TARGETS))
    assert load_parallel_files(source, target)["source"] == SOURCES


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_tsv_round_trip(tmp_path, suffix):
    path = _write(tmp_path / f"train.tsv{suffix}", _lines(TSV_LINES))
    ds = load_tsv(path)
    assert ds["source"] == SOURCES and ds["target"] == TARGETS


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_jsonl_round_trip(tmp_path, suffix):
    records = [{"en": s, "de": t, "id": i} for i, (s, t) in enumerate(zip(SOURCES, TARGETS, strict=True))]
    data = "\n".join(json.dumps(record, ensure_ascii=i % 2 == 0) for i, record in enumerate(records)).encode()
    path = _write(tmp_path / f"train.jsonl{suffix}", data)
    ds = load_jsonl(path, source_key="en", target_key="de")
    assert ds.column_names == ["source", "target"]
    assert ds["source"] == SOURCES and ds["target"] == TARGETS


PARALLEL = ("a.en", "a.de")
BAD_FILES = [
    ("empty source side", {"a.en": b"one\n  \nthree\n", "a.de": b"eins\nzwei\ndrei\n"}, PARALLEL, "a.en", 2),
    ("empty target side", {"a.en": b"one\ntwo\n", "a.de": b"eins\n\t\n"}, PARALLEL, "a.de", 2),
    ("undecodable", {"a.en": b"one\ntwo \xff\xfe\n", "a.de": b"eins\nzwei\n"}, PARALLEL, "a.en", 2),
    (
        "undecodable gzip",
        {"b.en.gz": b"one\ntwo\nth\xe9ree\n", "b.de.gz": b"eins\nzwei\ndrei\n"},
        ("b.en.gz", "b.de.gz"),
        "b.en.gz",
        3,
    ),
    ("tsv latin-1", {"c.tsv": b"one\teins\nStra\xdfe\tstreet\n"}, "c.tsv", "c.tsv", 2),
    ("tsv without tab", {"c.tsv": b"one\teins\ntwo zwei\n"}, "c.tsv", "c.tsv", 2),
    ("tsv with two tabs", {"c.tsv": b"one\teins\ntwo\tzwei\tdrei\n"}, "c.tsv", "c.tsv", 2),
    ("tsv empty target", {"c.tsv": b"one\teins\ntwo\teins\nthree\t  \n"}, "c.tsv", "c.tsv", 3),
    ("tsv blank line", {"c.tsv": b"one\teins\n\ntwo\tzwei\n"}, "c.tsv", "c.tsv", 2),
    ("jsonl invalid", {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": "a",\n'}, "d.jsonl", "d.jsonl", 2),
    (
        "jsonl missing key",
        {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": "c", "target": "d"}\n{"source": "e"}\n'},
        "d.jsonl",
        "d.jsonl",
        3,
    ),
    ("jsonl not an object", {"d.jsonl": b'["a", "b"]\n'}, "d.jsonl", "d.jsonl", 1),
    (
        "jsonl empty side",
        {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": " ", "target": "b"}\n'},
        "d.jsonl",
        "d.jsonl",
        2,
    ),
    ("jsonl non-string", {"d.jsonl": b'{"source": 3, "target": "b"}\n'}, "d.jsonl", "d.jsonl", 1),
    ("empty file", {"e.tsv": b""}, "e.tsv", "e.tsv", 1),
]


@pytest.mark.parametrize(
    ("files", "spec", "bad_file", "line"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_files_name_the_file_and_line(tmp_path, files, spec, bad_file, line):
    for name, data in files.items():
        _write(tmp_path / name, data)
    with pytest.raises(ValueError) as error:
        if isinstance(spec, tuple):
            load_parallel_files(tmp_path / spec[0], tmp_path / spec[1])
        elif spec.endswith(".tsv"):
            load_tsv(tmp_path / spec)
        else:
            load_jsonl(tmp_path / spec)
    message = str(error.value)
    assert bad_file in message
    assert re.search(rf"\bline {line}\b", message), message


NUL_FILES = [
    ("all NUL bytes", {"a.en": b"\0" * 64, "a.de": b"eins\n"}, PARALLEL, "a.en", 1, 1),
    ("NUL gzip", {"b.en.gz": b"one\ntwo\n", "b.de.gz": b"eins\nzw\0ei\n"}, ("b.en.gz", "b.de.gz"), "b.de.gz", 2, 3),
    ("UTF-16", {"a.en": "one\n".encode("utf-16-le"), "a.de": b"eins\n"}, PARALLEL, "a.en", 1, 2),
    ("tsv NUL", {"c.tsv": b"one\teins\n\0\0\0\t\0\n"}, "c.tsv", "c.tsv", 2, 1),
    (
        "jsonl NUL",
        {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": "a\0", "target": "b"}\n'},
        "d.jsonl",
        "d.jsonl",
        2,
        14,
    ),
]


@pytest.mark.parametrize(
    ("files", "spec", "bad_file", "line", "column"), [c[1:] for c in NUL_FILES], ids=[c[0] for c in NUL_FILES]
)
def test_nul_bytes_are_refused_naming_the_file_line_and_column(tmp_path, files, spec, bad_file, line, column):
    for name, data in files.items():
        _write(tmp_path / name, data)
    with pytest.raises(
        ValueError, match=rf"{re.escape(bad_file)}, line {line}: NUL byte at column {column}; not a text"
    ):
        if isinstance(spec, tuple):
            load_parallel_files(tmp_path / spec[0], tmp_path / spec[1])
        else:
            load_corpus("files", train=tmp_path / spec)


def test_only_line_feed_ends_a_line(tmp_path):
    # A lone CR (old Mac line end, or a stray control character) stays inside its line: splitting on it would shift
    # every later line of one side against the other.
    source = _write(tmp_path / "a.en", b"one\rhalf\ntwo\r\n")
    target = _write(tmp_path / "a.de", b"eins\nzwei\n")
    assert load_parallel_files(source, target)["source"] == ["one\rhalf", "two"]
    tsv = _write(tmp_path / "c.tsv", b"one\rhalf\teins\r\ntwo\tzwei\n")
    assert load_tsv(tsv)["source"] == ["one\rhalf", "two"] and load_tsv(tsv)["target"] == ["eins", "zwei"]


@pytest.mark.parametrize(("source_lines", "target_lines"), [(3, 2), (2, 4)])
def test_mismatched_line_counts_name_both_files_and_counts(tmp_path, source_lines, target_lines):
    source = _write(tmp_path / "m.en", _lines([f"s{i}" for i in range(source_lines)]))
    target = _write(tmp_path / "m.de", _lines([f"t{i}" for i in range(target_lines)]))
    with pytest.raises(ValueError) as error:
        load_parallel_files(source, target)
    message = str(error.value)
    assert "m.en" in message and "m.de" in message
    assert f"{source_lines} lines" in message and f"has {target_lines}" in message
    assert f"line {min(source_lines, target_lines) + 1}" in message


def test_load_corpus_files_mixes_formats(tmp_path):
    source = _write(tmp_path / "train.en", _lines(SOURCES))
    target = _write(tmp_path / "train.de", _lines(TARGETS))
    tsv = _write(tmp_path / "valid.tsv.gz", _lines(TSV_LINES[:2]))
    jsonl = _write(tmp_path / "test.jsonl", _lines([json.dumps({"source": SOURCES[2], "target": TARGETS[2]})]))
    corpus = load_corpus("files", train=(source, target), validation=str(tsv), test=jsonl)
    assert list(corpus) == ["train", "validation", "test"]
    assert corpus["train"]["target"] == TARGETS
    assert corpus["validation"]["source"] == SOURCES[:2]
    assert corpus["test"]["target"] == TARGETS[2:]
    only_train = load_corpus("files", train=[str(source), str(target)])
    assert list(only_train) == ["train"]


def test_load_corpus_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="unknown corpus source"):
        load_corpus("ftp")
    with pytest.raises(ValueError, match="train"):
        load_corpus("files", validation=("a", "b"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_corpus("files", train=str(_write(tmp_path / "train.csv", b"a,b\n")))
    with pytest.raises(ValueError, match="unknown option"):
        load_corpus("files", train=("a", "b"), num_tran=5)


def test_load_corpus_refuses_the_generated_demo_corpus():
    # The embedded corpus is generated by hf_vaswani.data.demo_corpus, not loaded.
    with pytest.raises(ValueError, match=r"unknown corpus source 'synthetic'; expected 'files' or 'hub'"):
        load_corpus("synthetic")


# ----------------------------------------------------------------------------------------------------------------------
# Hub translation datasets, exercised on local copies
# ----------------------------------------------------------------------------------------------------------------------

HUB_ROWS = {
    "train": [("Guten Morgen.", "Good morning."), ("Danke.", "Thank you."), ("Ja.", "Yes.")],
    "validation": [("Nein.", "No.")],
    "test": [("Hallo Welt.", "Hello world."), ("Tschüss.", "Bye.")],
}


def _translation_dict(features: datasets.Features) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {"translation": [{"de": de, "en": en} for de, en in rows], "id": [str(i) for i in range(len(rows))]},
                features=features,
            )
            for split, rows in HUB_ROWS.items()
        }
    )


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    # Parquet shards named like the Hub's (data/{split}-00000-of-00001.parquet), with the datasets.Translation feature
    # that wmt14 declares; and a save_to_disk copy whose translation column is a plain struct.
    parquet = root / "wmt_like"
    translation = datasets.Translation(languages=["de", "en"])
    for split, ds in _translation_dict(
        datasets.Features({"translation": translation, "id": datasets.Value("string")})
    ).items():
        ds.to_parquet(str(parquet / "data" / f"{split}-00000-of-00001.parquet"))
    saved = root / "saved"
    struct = {"de": datasets.Value("string"), "en": datasets.Value("string")}
    _translation_dict(datasets.Features({"translation": struct, "id": datasets.Value("string")})).save_to_disk(
        str(saved)
    )
    no_translation = root / "no_translation"
    datasets.Dataset.from_dict({"de": ["a"], "en": ["b"]}).to_parquet(str(no_translation / "data" / "train-0.parquet"))
    return {"parquet": parquet, "saved": saved, "no_translation": no_translation, "cache": root / "cache"}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_hub_loader_maps_translation_to_source_and_target(hub_dirs, offline, kind):
    corpus = load_hub_translation(str(hub_dirs[kind]), None, "en", "de", cache_dir=str(hub_dirs["cache"]))
    assert sorted(corpus) == ["test", "train", "validation"]
    for split, rows in HUB_ROWS.items():
        assert corpus[split].features == FEATURES
        assert corpus[split]["source"] == [en for _, en in rows]
        assert corpus[split]["target"] == [de for de, _ in rows]


def test_hub_loader_direction_and_split_map(hub_dirs, offline):
    corpus = load_corpus(
        "hub",
        name=str(hub_dirs["parquet"]),
        source_lang="de",
        target_lang="en",
        split_map={"train": "train", "validation": "test"},
        cache_dir=str(hub_dirs["cache"]),
    )
    assert list(corpus) == ["train", "validation"]
    assert corpus["validation"]["source"] == [de for de, _ in HUB_ROWS["test"]]
    assert corpus["validation"]["target"] == [en for _, en in HUB_ROWS["test"]]


def test_hub_loader_errors_name_what_is_available(hub_dirs, offline):
    cache = str(hub_dirs["cache"])
    with pytest.raises(ValueError, match=r"'fr'.*\['de', 'en'\]"):
        load_hub_translation(str(hub_dirs["parquet"]), None, "fr", "en", cache_dir=cache)
    with pytest.raises(ValueError, match=r"no split 'dev'.*train"):
        load_hub_translation(
            str(hub_dirs["parquet"]), None, "en", "de", split_map={"validation": "dev"}, cache_dir=cache
        )
    with pytest.raises(ValueError, match=r"no 'translation' column.*\['de', 'en'\]"):
        load_hub_translation(str(hub_dirs["no_translation"]), None, "en", "de", cache_dir=cache)
