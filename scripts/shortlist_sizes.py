"""Vocabulary shortlist sizes against the full vocabulary: BLEU, changed translations and list sizes, on one split.

For each (per-source, frequent) pair, a shortlist is built from the training pair of files with the model's tokenizer,
the split is translated with and without it, and this prints a JSON line: BLEU on whitespace tokens (the score of text
prepared as scripts/prepare_multi30k.py prepares it) with the shortlist and without, the share of translations that
change, and the mean list size of a batch of 8 sentences (the benchmark's decoding batch).

    python scripts/shortlist_sizes.py MODEL_DIR DATA_DIR --split val --sizes 10,100 20,100 50,100 100,300
    python scripts/shortlist_sizes.py MODEL_DIR DATA_DIR --split test_2016_flickr --sizes 50,100

DATA_DIR holds train, SPLIT .SRC.gz/.TGT.gz files (Multi30k's layout); sizes are chosen on val, never on a test set.
"""

import argparse
import json
import statistics

from hf_vaswani.data.corpus import load_parallel_files
from hf_vaswani.data.tokenization import encode_padded
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.decoding.metrics import whitespace_bleu
from hf_vaswani.decoding.shortlist import shortlist_of_corpus
from hf_vaswani.decoding.translation import translate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("--split", default="val")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--target-lang", default="de")
    parser.add_argument("--sizes", nargs="+", default=["50,100"], help="PER_SOURCE,FREQUENT pairs")
    args = parser.parse_args()
    sizes = [tuple(int(n) for n in pair.split(",")) for pair in args.sizes]
    model, tokenizer = load_model_folder(args.model)

    def split_files(split: str) -> tuple[str, str]:
        return f"{args.data}/{split}.{args.source_lang}.gz", f"{args.data}/{split}.{args.target_lang}.gz"

    train, test = load_parallel_files(*split_files("train")), load_parallel_files(*split_files(args.split))
    sources, references = list(test["source"]), list(test["target"])
    full = translate(model, tokenizer, sources, progress=False)
    for per_source, frequent in sizes:
        shortlist = shortlist_of_corpus(
            tokenizer, list(train["source"]), list(train["target"]), len(tokenizer), per_source, frequent
        )
        listed = []
        for start in range(0, len(sources), 8):
            batch = encode_padded(tokenizer, sources[start : start + 8])
            listed.append(len(shortlist.columns(batch["input_ids"], batch["attention_mask"])))
        shortlisted = translate(model, tokenizer, sources, progress=False, shortlist=shortlist)
        report = {
            "split": args.split,
            "per_source": per_source,
            "frequent": frequent,
            "bleu_full": round(whitespace_bleu(full, references), 2),
            "bleu_shortlist": round(whitespace_bleu(shortlisted, references), 2),
            "changed": round(sum(a != b for a, b in zip(full, shortlisted, strict=True)) / len(full), 4),
            "listed_tokens_batch_of_8": round(statistics.mean(listed)),
            "vocabulary": len(tokenizer),
        }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
