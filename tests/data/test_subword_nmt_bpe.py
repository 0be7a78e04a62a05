"""kind="subword_nmt": BPE as Sennrich et al. (2016) learn and apply it, against their subword-nmt and their
Algorithm 1, the same in every process."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_vaswani.data.tokenization import END_OF_WORD, SPECIAL_TOKENS, train_shared_bpe

# Lowercased, tokenized text, as the recipes that used subword-nmt prepared it; both sides feed one BPE.
CORPUS = [
    "a man in a blue shirt is standing on a ladder cleaning windows .",
    "ein mann in einem blauen hemd steht auf einer leiter und putzt fenster .",
    "two young children are playing in the sand near the water .",
    "zwei kleine kinder spielen im sand nahe dem wasser .",
    "a woman with a large purse is walking by a gate .",
    "eine frau mit einer großen geldbörse geht an einem tor vorbei .",
    "the brown dog is running through the tall grass .",
    "der braune hund rennt durch das hohe gras .",
    "several men in hard hats are operating a giant pulley system .",
    "mehrere männer mit schutzhelmen bedienen ein antriebsradsystem .",
    "a little girl climbing into a wooden playhouse .",
    "ein kleines mädchen klettert in ein spielhaus aus holz .",
    "a boy in a red t-shirt jumps off a dock .",
    "ein junge in einem roten t-shirt springt von einem steg .",
]
MIN_FREQUENCY = 2
# Words unseen in training, made of seen characters only (subword-nmt keeps unseen characters; this BPE gives <unk>).
HELD_OUT = [
    "a girl in a blue hat is cleaning the ladder near the gate .",
    "zwei männer spielen mit einem braunen hund im hohen gras .",
    "windowsill sandstorm playhouses grassland t-shirts off-road",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_shared_bpe(CORPUS * 3, vocab_size=300, min_frequency=MIN_FREQUENCY, kind="subword_nmt")


def merges(tokenizer: PreTrainedTokenizerFast) -> list[tuple[str, str]]:
    return [tuple(pair) for pair in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]


def subword_nmt_words(tokens: list[str]) -> str:
    """Tokens in subword-nmt's notation: "@@" after each symbol that does not end a word."""
    words = (token.removesuffix(END_OF_WORD) if token.endswith(END_OF_WORD) else token + "@@" for token in tokens)
    return " ".join(words)


def test_segmentation_is_subword_nmts_with_the_same_merges(tokenizer: PreTrainedTokenizerFast) -> None:
    # The learnt merges as a subword-nmt codes file (version 0.2 marks the end of a word with </w>, as here).
    codes = io.StringIO("#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in merges(tokenizer)))
    reference = BPE(codes)
    for text in CORPUS + HELD_OUT:
        assert subword_nmt_words(tokenizer.tokenize(text)) == reference.process_line(text)


def remaining_pair_counts(learnt: list[tuple[str, str]]) -> Counter[tuple[str, str]]:
    """Algorithm 1 of Sennrich et al. (2016) checked on `learnt`: each merge joins a most frequent pair of adjacent
    symbols, counted over the corpus' words segmented by the merges before it. Returns the pair counts after the last
    merge (learning stops when none is frequent enough or the vocabulary is full)."""
    word_counts = Counter(word for text in CORPUS * 3 for word in text.split())
    words = {word: [*word[:-1], word[-1] + END_OF_WORD] for word in word_counts}

    def pair_counts() -> Counter[tuple[str, str]]:
        counts: Counter[tuple[str, str]] = Counter()
        for word, symbols in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] += word_counts[word]
        return counts

    for pair in learnt:
        counts = pair_counts()
        assert counts[pair] == max(counts.values()) >= MIN_FREQUENCY, pair
        for word, symbols in words.items():
            merged, index = [], 0
            while index < len(symbols):
                if tuple(symbols[index : index + 2]) == pair:
                    merged.append(pair[0] + pair[1])
                    index += 2
                else:
                    merged.append(symbols[index])
                    index += 1
            words[word] = merged
    return pair_counts()


def test_each_merge_is_a_most_frequent_pair(tokenizer: PreTrainedTokenizerFast) -> None:
    learnt = merges(tokenizer)
    assert len(learnt) > 50
    assert len(tokenizer) == 300 or max(remaining_pair_counts(learnt).values(), default=0) < MIN_FREQUENCY


def test_a_word_is_the_same_tokens_wherever_it_stands(tokenizer: PreTrainedTokenizerFast) -> None:
    alone = tokenizer.tokenize("ladder")
    assert tokenizer.tokenize("ladder a man")[: len(alone)] == alone
    assert tokenizer.tokenize("a man ladder")[-len(alone) :] == alone


def test_decoding_joins_words_and_unseen_characters_are_unknown(tokenizer: PreTrainedTokenizerFast) -> None:
    for text in HELD_OUT:
        ids = tokenizer(text_target=text).input_ids
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    spaced = "  ein   mann\tsteht .  "
    assert tokenizer.decode(tokenizer(spaced).input_ids, skip_special_tokens=True) == "ein mann steht ."
    ids = tokenizer("ein mann mit 3 ¥").input_ids
    assert ids[-3:] == [tokenizer.unk_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id]


def test_save_and_autotokenizer_load_keep_the_segmentation(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in HELD_OUT:
        assert loaded(text).input_ids == tokenizer(text).input_ids
        assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True) == text


def test_unknown_kind_and_too_small_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        train_shared_bpe(CORPUS, vocab_size=300, kind="wordpiece")
    with pytest.raises(ValueError, match="no room beside the 4 special tokens"):
        train_shared_bpe(CORPUS, vocab_size=4, kind="subword_nmt")


def subword_nmt_merges(texts: list[str], merges: int) -> list[tuple[str, str]]:
    """subword-nmt's `learn-bpe -s merges` on `texts` (its codes file, version header dropped)."""
    codes = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):  # its progress and "no pair has frequency >= 2"
        learn_bpe(io.StringIO("".join(text + "\n" for text in texts)), codes, merges, min_frequency=MIN_FREQUENCY)
    return [tuple(line.split()) for line in codes.getvalue().splitlines()[1:]]


@pytest.mark.parametrize("count", [1, 17, 120])
def test_a_count_of_merges_learns_subword_nmts_merges_in_its_order(count: int) -> None:
    # The corpus has many pairs of equal frequency: the order among them is subword-nmt's (the larger pair first).
    sized = train_shared_bpe(CORPUS * 3, merges=count, min_frequency=MIN_FREQUENCY, kind="subword_nmt")
    learnt = merges(sized)
    assert learnt == subword_nmt_merges(CORPUS * 3, count) and len(learnt) == count
    remaining_pair_counts(learnt)
    # the vocabulary: the special tokens, each character of a word and each word-final one marked, and the merges'
    words = {word for text in CORPUS for word in text.split()}
    initial = {character for word in words for character in word} | {word[-1] + END_OF_WORD for word in words}
    assert set(sized.get_vocab()) == set(SPECIAL_TOKENS) | initial | {left + right for left, right in learnt}


def test_a_count_of_merges_stops_where_the_corpus_runs_out_of_pairs() -> None:
    count = 5000  # far more than the corpus' pairs occurring twice support
    learnt = merges(train_shared_bpe(CORPUS * 3, merges=count, min_frequency=MIN_FREQUENCY, kind="subword_nmt"))
    assert 200 < len(learnt) < count and len(subword_nmt_merges(CORPUS * 3, count)) < count
    assert max(remaining_pair_counts(learnt).values(), default=0) < MIN_FREQUENCY


def test_a_count_of_merges_sizes_subword_nmts_bpe_only() -> None:
    with pytest.raises(ValueError, match="sizes subword_nmt's BPE only"):
        train_shared_bpe(CORPUS, merges=100, kind="byte_level")
    with pytest.raises(ValueError, match="merges must be >= 1, got 0"):
        train_shared_bpe(CORPUS, merges=0, kind="subword_nmt")


LEARN_IN_A_NEW_PROCESS = """
import sys
from tests_corpus import CORPUS
from hf_vaswani.data.tokenization import train_shared_bpe
tokenizer = train_shared_bpe(CORPUS * 3, vocab_size=300, kind="subword_nmt")
sys.stdout.write(tokenizer.backend_tokenizer.to_str())
"""


def test_every_process_learns_the_same_bpe(tmp_path: Path) -> None:
    # Hash maps are seeded per process (Python's str hashes, Rust's RandomState), so one process could not show it.
    (tmp_path / "tests_corpus.py").write_text(f"CORPUS = {CORPUS!r}\n")
    learnt = [
        subprocess.run(
            [sys.executable, "-c", LEARN_IN_A_NEW_PROCESS], cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert learnt[0] == learnt[1]
    assert len(json.loads(learnt[0])["model"]["vocab"]) == 300
