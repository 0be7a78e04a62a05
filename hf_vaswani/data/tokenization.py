"""Shared source-target byte-pair encoding (Vaswani et al., 2017, §5.1), trained with `tokenizers`.

The paper encodes English-German with "byte-pair encoding, which has a shared source-target vocabulary of about
37000 tokens": one BPE model is learnt on the concatenation of both sides, so the encoder and decoder embeddings (and
the pre-softmax projection, which the paper ties to them) index the same vocabulary.

Design choices, and why:

* **Byte-level BPE** (GPT-2 style `ByteLevel` pre-tokenizer and decoder, no normalizer). The 256 byte symbols are
  always in the vocabulary, so no input ever maps to `<unk>` (umlauts, CJK, emoji all decompose into bytes at
  worst), and decoding inverts encoding byte for byte: whitespace runs, tabs, newlines, leading/trailing spaces and
  Unicode forms (NFC vs NFD) are preserved exactly. Nothing is normalised. The paper's subword-nmt BPE worked on
  Moses-tokenized text instead and needed detokenization afterwards; byte-level BPE needs neither.
* No prefix space is added, so a word at the very start of a text is a different token from the same word after a
  space (`"Haus"` vs `" Haus"`); the price of exact round trips, and standard for byte-level BPE.
* `kind="subword_nmt"` learns BPE as Sennrich et al. (2016) and their subword-nmt did, for recipes of that era
  (fairseq's Multi30k and WMT runs): on the characters of whitespace-separated words, each word's last symbol marked as
  its end (`</w>`), so a word is the same tokens wherever it stands. Characters unseen in training encode as `<unk>`,
  and decoding joins the words with single spaces: for text already tokenized and normalised, as those recipes were.
  Its merges are learnt by subword-nmt itself, so the same text gives the same merges, in subword-nmt's order, on every
  run; tokenizers applies them.
* Special tokens take fixed ids, those the model config defaults to: `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3.
* Every encoding, source (`tokenizer(text)`) or target (`tokenizer(text_target=...)`), ends with `</s>` and has no
  `<s>`: the decoder is started with `<s>` (`decoder_start_token_id`), the labels end with `</s>`. The template lives
  in the backend tokenizer's post-processor, which `save_pretrained` writes into `tokenizer.json`.
* `split_special_tokens=True`: a literal `"</s>"` inside input text is encoded as ordinary bytes rather than as the
  control token, so text containing it still round-trips and cannot inject control tokens.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from subword_nmt.learn_bpe import learn_bpe
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import BatchEncoding, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..model.errors_vaswani import UsageError

if TYPE_CHECKING:
    from datasets import Dataset

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
END_OF_WORD = "</w>"  # subword-nmt's mark on the last symbol of a word
# Order matters: special tokens take the first ids in list order, which must match VaswaniConfig's pad/bos/eos
# defaults (0, 1, 2).
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
SPECIAL_TOKEN_IDS: dict[str, int] = {token: index for index, token in enumerate(SPECIAL_TOKENS)}

# With sinusoidal positions (the default) the model has no length limit; transformers warns about inputs longer than
# model_max_length and truncates to it when truncation=True without max_length, so make it effectively unbounded.
MODEL_MAX_LENGTH = 1_000_000

# Smallest vocabulary that still holds every byte plus the special tokens; below it BPE could not encode
# arbitrary text without <unk>.
MIN_VOCAB_SIZE = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
BPE_KINDS = ("byte_level", "subword_nmt")
VOCAB_SIZE = 37000  # §5.1: "a shared source-target vocabulary of about 37000 tokens"

__all__ = [
    "BOS_TOKEN",
    "BPE_KINDS",
    "EOS_TOKEN",
    "MIN_VOCAB_SIZE",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "SPECIAL_TOKEN_IDS",
    "UNK_TOKEN",
    "VOCAB_SIZE",
    "load_trained_bpe",
    "train_shared_bpe",
    "train_shared_bpe_from_dataset",
]


def _check_training_arguments(vocab_size: int, min_frequency: int, kind: str, merges: int | None = None) -> None:
    if kind not in BPE_KINDS:
        raise UsageError(f"kind must be one of {BPE_KINDS}, got {kind!r}")
    if merges is not None and kind != "subword_nmt":
        raise UsageError(f"a count of merges sizes subword_nmt's BPE only; size {kind}'s with vocab_size")
    if merges is not None and merges < 1:
        raise UsageError(f"merges must be >= 1, got {merges}")
    if kind == "byte_level" and vocab_size < MIN_VOCAB_SIZE:
        raise UsageError(
            f"vocab_size={vocab_size} is too small: byte-level BPE needs the {MIN_VOCAB_SIZE - len(SPECIAL_TOKENS)} "
            f"byte symbols plus {len(SPECIAL_TOKENS)} special tokens, i.e. vocab_size >= {MIN_VOCAB_SIZE}"
        )
    if vocab_size <= len(SPECIAL_TOKENS):
        raise UsageError(f"vocab_size={vocab_size} leaves no room beside the {len(SPECIAL_TOKENS)} special tokens")
    if min_frequency < 1:
        raise UsageError(f"min_frequency must be >= 1, got {min_frequency}")


def _byte_level_bpe(texts: Iterable[str] | Iterable[list[str]], vocab_size: int, min_frequency: int) -> Tokenizer:
    """GPT-2's byte-level BPE learnt on `texts` by tokenizers' trainer. Every symbol it starts from is in its initial
    alphabet, so the ids that break ties between pairs of equal frequency, and so its merges, are the same each run."""
    # unk_token is set for completeness only: with the full byte alphabet in the vocabulary it is never produced.
    backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        # Seed with all 256 bytes, not just those seen in training, so unseen characters stay encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def _subword_nmt_bpe(
    texts: Iterable[str] | Iterable[list[str]], vocab_size: int, min_frequency: int, merges: int | None
) -> Tokenizer:
    """Sennrich et al.'s BPE, its merges learnt by their subword-nmt and applied by tokenizers. tokenizers' trainer
    cannot stand in: it breaks ties between pairs of equal frequency by the ids it gives word-final symbols in
    hash-map order, so its merges change from run to run; subword-nmt breaks them by the pairs themselves."""
    pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    strings = chain.from_iterable([text] if isinstance(text, str) else text for text in texts)
    word_counts = Counter(word for text in strings for word, _ in pre_tokenizer.pre_tokenize_str(text))
    characters = sorted({character for word in word_counts for character in word})
    initial = characters + sorted({word[-1] + END_OF_WORD for word in word_counts})
    wanted = merges if merges is not None else vocab_size - len(SPECIAL_TOKENS) - len(initial)
    learnt = _learnt_merges(word_counts, wanted, min_frequency)
    vocab: dict[str, int] = {}
    for token in chain(SPECIAL_TOKENS, initial, (left + right for left, right in learnt)):
        vocab.setdefault(token, len(vocab))
    # Two merges can make the same token; to fill `vocab_size`, learn as many more as that left unfilled.
    while merges is None and len(learnt) == wanted and len(vocab) < vocab_size:
        wanted += vocab_size - len(vocab)
        learnt = _learnt_merges(word_counts, wanted, min_frequency)
        for left, right in learnt:
            vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=learnt, unk_token=UNK_TOKEN, end_of_word_suffix=END_OF_WORD))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.BPEDecoder(suffix=END_OF_WORD)
    return backend


def _learnt_merges(word_counts: Counter[str], count: int, min_frequency: int) -> list[tuple[str, str]]:
    """The first `count` merges subword-nmt's `learn-bpe` learns from `word_counts` (fewer where no pair is left
    occurring `min_frequency` times). Each merge depends on the earlier ones alone, so a longer run extends a shorter
    one."""
    if count < 1:
        return []
    counts_file = io.StringIO("".join(f"{word} {n}\n" for word, n in sorted(word_counts.items())))
    codes = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar and "no pair has frequency >= N. Stopping"
        learn_bpe(counts_file, codes, count, min_frequency=min_frequency, is_dict=True)
    lines = codes.getvalue().splitlines()[1:]  # after its "#version: 0.2" header
    return [(left, right) for left, right in (line.split(" ") for line in lines)]


def _train(
    texts: Iterable[str] | Iterable[list[str]],
    vocab_size: int,
    min_frequency: int,
    kind: str,
    merges: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train the BPE of `kind` on `texts` (strings or batches of strings) and wrap it for transformers; with `merges`,
    subword_nmt's BPE of that many merges (`vocab_size` unused)."""
    _check_training_arguments(vocab_size, min_frequency, kind, merges)
    if kind == "byte_level":
        backend = _byte_level_bpe(texts, vocab_size, min_frequency)
    else:
        backend = _subword_nmt_bpe(texts, vocab_size, min_frequency, merges)

    for token, expected_id in SPECIAL_TOKEN_IDS.items():
        actual_id = backend.token_to_id(token)
        if actual_id != expected_id:  # would silently break the model config's pad/bos/eos ids
            raise RuntimeError(f"special token {token!r} got id {actual_id}, expected {expected_id}")

    # Pair template is there for completeness (e.g. tokenizer(a, b)); each segment is closed by </s>.
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {EOS_TOKEN}:0",
        pair=f"$A:0 {EOS_TOKEN}:0 $B:1 {EOS_TOKEN}:1",
        special_tokens=[(EOS_TOKEN, SPECIAL_TOKEN_IDS[EOS_TOKEN])],
    )
    return _wrapped(backend)


def _wrapped(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The trained BPE as the transformers tokenizer of this package's models."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        # The default clean-up would delete spaces before punctuation (" ." -> ".") and break exact round trips.
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        model_input_names=["input_ids", "attention_mask"],
    )


def train_shared_bpe(
    texts: Iterable[str],
    vocab_size: int = VOCAB_SIZE,
    min_frequency: int = 2,
    kind: str = "byte_level",
    merges: int | None = None,
) -> PreTrainedTokenizerFast:
    """Learn one BPE vocabulary on source and target text together (the paper's shared vocabulary).

    Args:
        texts: training sentences, source and target sides mixed (e.g. `chain(sources, targets)`); any iterable,
            consumed once.
        vocab_size: size of the final vocabulary, special tokens and the symbols merges start from included: for
            byte_level the 256 bytes, so at least `MIN_VOCAB_SIZE` (260); for subword_nmt every character seen, plain
            and word-final. The result can be smaller when the corpus has too few frequent pairs (or, for
            subword_nmt, larger when its characters alone outnumber `vocab_size`).
        min_frequency: a pair must occur at least this often to be merged.
        kind: byte_level (GPT-2's) or subword_nmt (Sennrich et al.'s); see the module's notes.
        merges: for subword_nmt, the number of merges to learn instead of a vocabulary size, as subword-nmt's
            `learn-bpe -s` counts them and recipes of its era state their vocabularies (fewer when the corpus runs
            out of pairs occurring `min_frequency` times); `vocab_size` is then unused. The texts are held in memory.

    Returns:
        A fast tokenizer with `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3 that appends `</s>` to every encoding, source
        and `text_target` alike. `save_pretrained` writes `tokenizer_class: "TokenizersBackend"` (transformers 5's
        name for `PreTrainedTokenizerFast`), which `AutoTokenizer.from_pretrained` loads back unchanged.

    Raises:
        ValueError: if `kind` is unknown, `vocab_size` too small for it, `merges` < 1 or given for byte_level,
            `min_frequency` < 1, or `texts` a single string.
    """
    if isinstance(texts, str):  # iterating a str would train on its characters one by one
        raise UsageError("texts must be an iterable of strings, not a single string")
    return _train(texts, vocab_size, min_frequency, kind, merges)


def load_trained_bpe(folder: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer `train_shared_bpe` trained and `save_pretrained` wrote to `folder`, rebuilt exactly as trained.

    What it saves is byte-identical to what the trained one saved (a resumed run's checkpoints match the earlier ones);
    `AutoTokenizer.from_pretrained` would add how it was loaded (`is_local`, `local_files_only`) to what it saves.
    """
    return _wrapped(read_tokenizer_file(Path(folder) / "tokenizer.json"))


def encode_padded(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str] | None = None, **kwargs: object
) -> BatchEncoding:
    """`tokenizer(texts, padding=True, return_tensors="pt", **kwargs)`, the tokenizer left as it was found.

    A fast tokenizer's call sets its padding on the Rust backend and clears a truncation set there, and transformers
    leaves both so, where the next `save_pretrained` (a checkpoint saved after a validation) writes them into
    tokenizer.json as the tokenizer's own settings.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer keeps no call's settings
        return tokenizer(texts, padding=True, return_tensors="pt", **kwargs)
    padding, truncation = backend.padding, backend.truncation
    try:
        return tokenizer(texts, padding=True, return_tensors="pt", **kwargs)
    finally:
        if padding is None:
            backend.no_padding()
        else:
            backend.enable_padding(**padding)
        if truncation is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(**truncation)


def read_tokenizer_file(path: Path) -> Tokenizer:
    """The tokenizer of `path`, a tokenizer.json; a file it cannot read as one ValueError line naming it."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers reports every file it cannot read as a bare Exception
        if type(error) is not Exception:
            raise
        raise UsageError(f"{path} is not a tokenizer tokenizers can read: {' '.join(str(error).split())}") from None


def _dataset_batches(dataset: Dataset, columns: Sequence[str], batch_size: int) -> Iterator[list[str]]:
    # Batched slicing reads Arrow columns in bulk, much faster than row-by-row access; tokenizers accepts batches.
    for start in range(0, len(dataset), batch_size):
        batch = dataset[start : start + batch_size]
        for column in columns:
            yield [text for text in batch[column] if text]


def train_shared_bpe_from_dataset(
    dataset: Dataset,
    vocab_size: int = VOCAB_SIZE,
    min_frequency: int = 2,
    columns: Sequence[str] = ("source", "target"),
    batch_size: int = 1000,
    kind: str = "byte_level",
    merges: int | None = None,
) -> PreTrainedTokenizerFast:
    """`train_shared_bpe` on the text columns of a `datasets.Dataset` (by default `source` and `target`).

    Both columns feed the same BPE model, so the vocabulary is shared. Empty or missing (None) texts are skipped.

    Raises:
        ValueError: if a column is missing, `batch_size` < 1, or the vocabulary arguments are invalid.
    """
    if isinstance(columns, str):
        columns = (columns,)
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise UsageError(f"dataset has no column(s) {missing}; its columns are {dataset.column_names}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    _check_training_arguments(vocab_size, min_frequency, kind, merges)  # fail before iterating a large dataset
    return _train(_dataset_batches(dataset, columns, batch_size), vocab_size, min_frequency, kind, merges)
