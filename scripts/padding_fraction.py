"""Padding of the paper's length-grouped token batches versus random batches (§5.1).

Both batchings use the same number of batches, hence the same mean number of examples per batch, so the difference
is what grouping by length saves. Examples:

    python scripts/padding_fraction.py                       # the package's synthetic corpus, whitespace tokens
    python scripts/padding_fraction.py train.en train.de --tokenizer tokenizer/ --max-tokens 3125
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_vaswani.batching import TokenBatchSampler, padding_fraction, random_batches


def read_pairs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if args.source_file is None:
        from hf_vaswani.data import make_synthetic_corpus

        split = make_synthetic_corpus()[args.split]
        return list(split["source"]), list(split["target"])
    sources = Path(args.source_file).read_text(encoding="utf-8").splitlines()
    targets = Path(args.target_file).read_text(encoding="utf-8").splitlines()
    if len(sources) != len(targets):
        raise SystemExit(f"{args.source_file} has {len(sources)} lines but {args.target_file} has {len(targets)}")
    return sources, targets


def token_lengths(sources: list[str], targets: list[str], tokenizer_dir: str | None) -> tuple[list[int], list[int]]:
    if tokenizer_dir is None:
        # +1 for the end-of-sequence token every encoded sequence carries.
        return [len(text.split()) + 1 for text in sources], [len(text.split()) + 1 for text in targets]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    source_ids = tokenizer(sources)["input_ids"]
    target_ids = tokenizer(text_target=targets)["input_ids"]
    return [len(ids) for ids in source_ids], [len(ids) for ids in target_ids]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_file", nargs="?", help="one source sentence per line (default: synthetic corpus)")
    parser.add_argument("target_file", nargs="?", help="the aligned target sentences")
    parser.add_argument("--tokenizer", metavar="DIR", help="count tokens with this tokenizer instead of whitespace")
    parser.add_argument("--split", default="train", help="split of the synthetic corpus (default: train)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="padded tokens per batch and side; the paper's 25000 spread over 8 GPUs is about 3125 (default: 4096)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.source_file is None) != (args.target_file is None):
        parser.error("give both a source and a target file, or neither")

    sources, targets = read_pairs(args)
    source_lengths, target_lengths = token_lengths(sources, targets, args.tokenizer)
    token_batches = list(TokenBatchSampler(source_lengths, target_lengths, args.max_tokens, seed=args.seed))
    baseline = random_batches(len(source_lengths), len(token_batches), seed=args.seed)

    print(f"examples: {len(source_lengths)}  batches: {len(token_batches)}  max_tokens: {args.max_tokens}")
    print(
        f"mean length: source {sum(source_lengths) / len(source_lengths):.1f}  "
        f"target {sum(target_lengths) / len(target_lengths):.1f}"
    )
    print(f"padding fraction, token batches:  {padding_fraction(token_batches, source_lengths, target_lengths):.4f}")
    print(f"padding fraction, random batches: {padding_fraction(baseline, source_lengths, target_lengths):.4f}")


if __name__ == "__main__":
    main()
