"""Multi30k text as Wu et al. (2021) trained and scored on: lowercased, punctuation-normalized, Moses-tokenized.

The preprocessing of the multi30k/dataset repository (scripts/task1-tokenize.sh: `lowercase.perl |
normalize-punctuation.perl -l LANG | tokenizer.perl -l LANG`: XML escaping on, no aggressive hyphen splitting), which
LividWo/Revisit-MMT's data went through before its BPE, done with sacremoses. On the raw task-1 files this gives their
BPE-removed train, valid and test.2016 text line for line (the test reference: 12,103 tokens, their reflen).

    python scripts/prepare_multi30k.py DATA_DIR OUTPUT_DIR [--source-lang en --target-lang de]

scripts/multi30k.sh runs it on its DATA_DIR, into its OUTPUT_DIR/prepared, and trains on the prepared files.

Reads DATA_DIR/{train,val,test_2016_flickr}.{SRC,TGT}.gz (one sentence a line) and writes gzipped files of the same
names to OUTPUT_DIR. Score a model trained on them by BLEU over whitespace tokens of its output and of the prepared
test reference, as fairseq's scorer did; no further tokenization.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

from sacremoses import MosesPunctNormalizer, MosesTokenizer

SPLITS = ("train", "val", "test_2016_flickr")


def prepare_line(line: str, normalizer: MosesPunctNormalizer, tokenizer: MosesTokenizer) -> str:
    """One sentence through lowercase.perl, normalize-punctuation.perl and tokenizer.perl (escaping, no `-a`)."""
    # The Perl script sees each line with its newline, which one of its rules needs to match a sentence-final `."`
    # (German and other non-English text: `."` becomes `".`); the tokenizer strips it again.
    normalized = normalizer.normalize(line.lower() + "\n")
    return tokenizer.tokenize(normalized, return_str=True, escape=True, aggressive_dash_splits=False)


def prepare_file(source: Path, destination: Path, lang: str) -> int:
    """Writes the prepared lines of gzipped `source` to gzipped `destination`; returns the number of lines."""
    # perl_parity: the mapping of the Perl script, whose quirks (’ -> ") the published data carries
    normalizer = MosesPunctNormalizer(lang=lang, perl_parity=True)
    tokenizer = MosesTokenizer(lang=lang)
    count = 0
    with gzip.open(source, "rt", encoding="utf-8") as lines, gzip.open(destination, "wt", encoding="utf-8") as out:
        for line in lines:
            out.write(prepare_line(line.rstrip("\n"), normalizer, tokenizer) + "\n")
            count += 1
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path, help="folder of the raw Multi30k task-1 .gz files")
    parser.add_argument("output_dir", type=Path, help="folder the prepared .gz files are written to")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--target-lang", default="de")
    args = parser.parse_args(argv)
    files = [(f"{split}.{lang}.gz", lang) for split in SPLITS for lang in (args.source_lang, args.target_lang)]
    for name, _ in files:
        if not (args.data_dir / name).is_file():
            print(f"prepare_multi30k.py: error: {args.data_dir / name}: no such file", file=sys.stderr)
            raise SystemExit(2)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, lang in files:
        count = prepare_file(args.data_dir / name, args.output_dir / name, lang)
        print(f"{args.output_dir / name}: {count} lines", file=sys.stderr)


if __name__ == "__main__":
    main()
