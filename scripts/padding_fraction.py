"""Padding of the paper's length-grouped token batches versus random batches (§5.1).

Both batchings use the same number of batches, hence the same mean number of examples per batch, so the difference
is what grouping by length saves. Examples:

    python scripts/padding_fraction.py                       # the embedded demo corpus, whitespace tokens
    python scripts/padding_fraction.py train.en train.de --tokenizer tokenizer/ --max-tokens 3125

Results on the embedded corpus: docs/training.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from hf_vaswani.data.batching import TokenBatchSampler


def padding_fraction(
    batches: Iterable[Sequence[int]], source_lengths: Sequence[int], target_lengths: Sequence[int]
) -> float:
    """Fraction of the padded token slots that hold padding, over source and target tensors together.

    A batch of ``b`` examples occupies ``b * max(source lengths)`` source slots and ``b * max(target lengths)``
    target slots; the real tokens are the sums of the lengths.
    """
    source = np.asarray(source_lengths, dtype=np.int64)
    target = np.asarray(target_lengths, dtype=np.int64)
    slots = 0
    tokens = 0
    for batch in batches:
        index = np.asarray(batch, dtype=np.int64)
        if index.size == 0:
            continue
        batch_source = source[index]
        batch_target = target[index]
        slots += index.size * (int(batch_source.max()) + int(batch_target.max()))
        tokens += int(batch_source.sum()) + int(batch_target.sum())
    if slots == 0:
        raise ValueError("padding_fraction needs at least one batch with a non-empty sequence")
    return 1.0 - tokens / slots


def random_batches(num_examples: int, num_batches: int, seed: int = 0) -> list[list[int]]:
    """A random partition of ``range(num_examples)`` into ``num_batches`` batches of near-equal size.

    The length-blind baseline against which :class:`TokenBatchSampler`'s padding is measured.
    """
    if not 1 <= num_batches <= num_examples:
        raise ValueError(f"num_batches must be in [1, num_examples={num_examples}], got {num_batches}")
    permutation = np.random.default_rng(seed).permutation(num_examples)
    return [chunk.tolist() for chunk in np.array_split(permutation, num_batches)]


def read_pairs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    if args.source_file is None:
        from hf_vaswani.data.demo_corpus import make_synthetic_corpus

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
    parser.add_argument("source_file", nargs="?", help="one source sentence per line (default: the demo corpus)")
    parser.add_argument("target_file", nargs="?", help="the aligned target sentences")
    parser.add_argument("--tokenizer", metavar="DIR", help="count tokens with this tokenizer instead of whitespace")
    parser.add_argument("--split", default="train", help="split of the demo corpus (default: train)")
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
