"""Loaders of parallel corpora into `datasets.DatasetDict`s with exactly two string columns, `source` and `target`.

Two origins, both reached through `load_corpus`:

* ``"files"``: local parallel text (two plain files, TSV or JSONL, each optionally gzipped).
* ``"hub"``: a translation dataset with the standard ``translation`` column, such as ``wmt14`` ``de-en``.

Splits are named ``train``, ``validation`` and ``test``. The embedded demo corpus is generated rather than loaded, by
`hf_vaswani.data.demo_corpus.make_synthetic_corpus`, in the same two-column form.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import zlib
from collections.abc import Iterator, Mapping
from itertools import zip_longest
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset, DatasetDict, Features, Value

from ..model.errors_vaswani import UsageError

__all__ = [
    "FEATURES",
    "SPLITS",
    "load_corpus",
    "load_hub_translation",
    "load_jsonl",
    "load_parallel_files",
    "load_tsv",
]

SPLITS = ("train", "validation", "test")
FEATURES = Features({"source": Value("string"), "target": Value("string")})

PathLike = str | os.PathLike[str]

# ----------------------------------------------------------------------------------------------------------------------
# Local files
# ----------------------------------------------------------------------------------------------------------------------

_GZIP_MAGIC = b"\x1f\x8b"


def _is_gzip(path: Path) -> bool:
    if path.suffix.lower() == ".gz":
        return True
    with open(path, "rb") as handle:
        return handle.read(2) == _GZIP_MAGIC


def _read_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, text without line ending) of a UTF-8 file, gzipped or not.

    Only LF ends a line (binary files split on it alone); a CR right before it is a Windows line ending and dropped, a
    CR anywhere else is part of the line. NUL bytes are refused: text never holds them, binary and UTF-16 files do.
    """
    path = Path(path)
    lineno = 0
    try:
        with gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                raw = raw.removesuffix(b"\n").removesuffix(b"\r")
                if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8) :]
                nul = raw.find(b"\0")
                if nul >= 0:
                    raise UsageError(
                        f"{path}, line {lineno}: NUL byte at column {nul + 1}; not a text file (binary, or UTF-16?)"
                    )
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise UsageError(
                        f"{path}, line {lineno}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at column "
                        f"{error.start + 1})"
                    ) from None
                yield lineno, text
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zlib.error) as error:
        # A corrupt or truncated gzip stream fails while reading the line after the last good one.
        raise UsageError(f"{path}, line {lineno + 1}: cannot read the file: {error}") from error


def _checked_side(text: str, path: PathLike, lineno: int, side: str) -> str:
    text = text.strip()
    if not text:
        raise UsageError(f"{path}, line {lineno}: empty {side} sentence")
    return text


def _to_dataset(sources: list[str], targets: list[str], path: PathLike) -> Dataset:
    if not sources:
        raise UsageError(f"{path}, line 1: no sentence pairs (the file is empty)")
    return Dataset.from_dict({"source": sources, "target": targets}, features=FEATURES)


def load_parallel_files(source_path: PathLike, target_path: PathLike) -> Dataset:
    """Load two line-aligned plain-text files (one sentence per line, UTF-8, optionally gzipped) as one split."""
    sources: list[str] = []
    targets: list[str] = []
    source_lines, target_lines = _read_lines(source_path), _read_lines(target_path)
    for source_line, target_line in zip_longest(source_lines, target_lines):
        if source_line is None or target_line is None:
            # Count to the end of the longer file so the message can give both lengths.
            longer, rest = (target_path, target_lines) if source_line is None else (source_path, source_lines)
            extra = 1 + sum(1 for _ in rest)
            num_source = len(sources) + (extra if longer == source_path else 0)
            num_target = len(targets) + (extra if longer == target_path else 0)
            raise UsageError(
                f"{source_path} has {num_source} lines but {target_path} has {num_target}: "
                f"{longer}, line {len(sources) + 1} has no counterpart"
            )
        (lineno, source), (_, target) = source_line, target_line
        sources.append(_checked_side(source, source_path, lineno, "source"))
        targets.append(_checked_side(target, target_path, lineno, "target"))
    return _to_dataset(sources, targets, source_path)


def load_tsv(path: PathLike) -> Dataset:
    """Load ``source<TAB>target`` lines (UTF-8, optionally gzipped) as one split."""
    sources: list[str] = []
    targets: list[str] = []
    for lineno, text in _read_lines(path):
        fields = text.split("\t")
        if len(fields) != 2:
            raise UsageError(f"{path}, line {lineno}: expected exactly one tab, found {len(fields) - 1}")
        sources.append(_checked_side(fields[0], path, lineno, "source"))
        targets.append(_checked_side(fields[1], path, lineno, "target"))
    return _to_dataset(sources, targets, path)


def load_jsonl(path: PathLike, source_key: str = "source", target_key: str = "target") -> Dataset:
    """Load JSON Lines (one object per line with string fields ``source_key`` and ``target_key``) as one split."""
    sources: list[str] = []
    targets: list[str] = []
    for lineno, text in _read_lines(path):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}, line {lineno}: invalid JSON: {error.msg} at column {error.colno}") from None
        if not isinstance(record, dict):
            raise UsageError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
        values = []
        for key, side in ((source_key, "source"), (target_key, "target")):
            if key not in record:
                raise UsageError(f"{path}, line {lineno}: missing key {key!r} (keys: {sorted(record)})")
            if not isinstance(record[key], str):
                raise UsageError(f"{path}, line {lineno}: {key!r} is {type(record[key]).__name__}, not a string")
            values.append(_checked_side(record[key], path, lineno, side))
        sources.append(values[0])
        targets.append(values[1])
    return _to_dataset(sources, targets, path)


def _load_file_spec(spec: Any, split: str, source_key: str, target_key: str) -> Dataset:
    if isinstance(spec, (str, os.PathLike)):
        name = Path(spec).name.lower()
        if name.endswith((".tsv", ".tsv.gz")):
            return load_tsv(spec)
        if name.endswith((".jsonl", ".jsonl.gz")):
            return load_jsonl(spec, source_key, target_key)
        raise UsageError(
            f"{split}: cannot tell the format of {spec}; give a .tsv/.jsonl(.gz) file or a (source, target) pair"
        )
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return load_parallel_files(spec[0], spec[1])
    raise UsageError(f"{split}: expected a .tsv/.jsonl path or a (source_path, target_path) pair, got {spec!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Hub datasets
# ----------------------------------------------------------------------------------------------------------------------


def _translation_to_pairs(dataset: Dataset, where: str, source_lang: str, target_lang: str) -> Dataset:
    feature = dataset.features.get("translation")
    if feature is None:
        raise UsageError(f"{where} has no 'translation' column; columns: {dataset.column_names}")
    if isinstance(feature, datasets.Translation):
        languages = list(feature.languages)
    elif isinstance(feature, dict):
        languages = list(feature)
    else:
        raise UsageError(f"{where}: the 'translation' column is not a {{language: text}} mapping but {feature}")
    for language in (source_lang, target_lang):
        if language not in languages:
            raise UsageError(f"{where} has no language {language!r}; available: {languages}")
    source_column, target_column = f"translation.{source_lang}", f"translation.{target_lang}"
    # Flattening the struct column is an Arrow-level operation, far cheaper than a row-wise map over 4.5M WMT pairs.
    pairs = dataset.select_columns(["translation"]).flatten().select_columns([source_column, target_column])
    pairs = pairs.rename_columns({source_column: "source", target_column: "target"})
    return pairs if pairs.features == FEATURES else pairs.cast(FEATURES)


def load_hub_translation(
    name: str,
    config: str | None,
    source_lang: str,
    target_lang: str,
    *,
    split_map: Mapping[str, str] | None = None,
    **load_dataset_kwargs: Any,
) -> DatasetDict:
    """Load a dataset with a ``translation`` column of ``{language: text}`` (e.g. ``wmt14``/``de-en``) as source/target.

    ``name`` is anything `datasets.load_dataset` accepts (a Hub id or a local directory). ``split_map`` maps our split
    names to the dataset's (e.g. ``{"validation": "dev"}``); by default the dataset's train/validation/test are kept.
    """
    if source_lang == target_lang:
        raise UsageError(f"source_lang and target_lang are both {source_lang!r}")
    loaded = datasets.load_dataset(name, config, **load_dataset_kwargs)
    if isinstance(loaded, Dataset):
        split = load_dataset_kwargs.get("split")
        loaded = DatasetDict({split if isinstance(split, str) else "train": loaded})
    if not isinstance(loaded, DatasetDict):
        raise UsageError(f"{name}: expected a map-style DatasetDict, got {type(loaded).__name__} (streaming?)")
    if split_map is None:
        split_map = {split: split for split in SPLITS if split in loaded}
        if not split_map:
            raise UsageError(f"{name} has none of the splits {list(SPLITS)}; available: {list(loaded)}; pass split_map")
    result = {}
    for ours, theirs in split_map.items():
        if theirs not in loaded:
            raise UsageError(f"{name} has no split {theirs!r}; available: {list(loaded)}")
        where = f"{name} ({config}) split {theirs!r}" if config else f"{name} split {theirs!r}"
        result[ours] = _translation_to_pairs(loaded[theirs], where, source_lang, target_lang)
    return DatasetDict(result)


# ----------------------------------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------------------------------


def _reject_unknown(options: Mapping[str, Any], source: str) -> None:
    if options:
        raise UsageError(f"unknown option(s) for corpus source {source!r}: {sorted(options)}")


def load_corpus(source: str, **options: Any) -> DatasetDict:
    """Load a corpus as a DatasetDict with source/target columns; ``source`` is "files" or "hub".

    * ``"files"``: ``train`` (required), ``validation``, ``test``, each a ``(source_path, target_path)`` pair of plain
      text files or one ``.tsv``/``.jsonl`` path (optionally ``.gz``); ``source_key``/``target_key`` for JSONL.
    * ``"hub"``: ``name``, ``config=None``, ``source_lang``, ``target_lang``, ``split_map=None``; other options go to
      `datasets.load_dataset` (``cache_dir``, ``revision``, ...).
    """
    options = dict(options)
    if source == "files":
        if options.get("train") is None:
            raise UsageError("corpus source 'files' needs train=(source_path, target_path) or train=path.tsv/.jsonl")
        source_key = options.pop("source_key", "source")
        target_key = options.pop("target_key", "target")
        specs = {split: options.pop(split) for split in SPLITS if split in options}
        _reject_unknown(options, source)
        return DatasetDict(
            {
                split: _load_file_spec(spec, split, source_key, target_key)
                for split, spec in specs.items()
                if spec is not None
            }
        )
    if source == "hub":
        missing = [key for key in ("name", "source_lang", "target_lang") if options.get(key) is None]
        if missing:
            raise UsageError(f"corpus source 'hub' needs option(s) {missing}")
        return load_hub_translation(
            options.pop("name"),
            options.pop("config", None),
            options.pop("source_lang"),
            options.pop("target_lang"),
            split_map=options.pop("split_map", None),
            **options,
        )
    raise UsageError(f"unknown corpus source {source!r}; expected 'files' or 'hub'")
