"""Shared byte-level BPE tokenizer: special ids, </s> handling, exact round trips, save/load, shared vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_vaswani import VaswaniConfig
from hf_vaswani.data.tokenization import MIN_VOCAB_SIZE, encode_padded, train_shared_bpe, train_shared_bpe_from_dataset

SOURCES = [
    "The cat sits on the mat.",
    "I would like a cup of coffee, please.",
    "The meeting starts at 20:15 in Berlin.",
    "Prices rose by 3.14 percent to 1,000 euros.",
    'She said: "It\'s not my fault!"',
    "We're going to the station tomorrow morning.",
    "The government announced new measures on Tuesday.",
    "Children play in the park after school.",
]
TARGETS = [
    "Die Katze sitzt auf der Matte.",
    "Ich hätte gern eine Tasse Kaffee, bitte.",
    "Die Sitzung beginnt um 20:15 Uhr in Berlin.",
    "Die Preise stiegen um 3,14 Prozent auf 1.000 Euro.",
    "Sie sagte: „Es ist nicht meine Schuld!“",
    "Wir fahren morgen früh zum Bahnhof.",
    "Die Regierung kündigte am Dienstag neue Maßnahmen an.",
    "Kinder spielen nach der Schule im Park. Zwetschgenkuchen schmeckt der Großmutter.",
]
# Sentence pairs repeated with small variations so frequent words become single BPE tokens. "Zwetschgenkuchen" is in
# the targets only: the shared-vocabulary test encodes it as a source.
CORPUS_SOURCES = [f"{text} ({i})" for i in range(12) for text in SOURCES]
CORPUS_TARGETS = [f"{text} ({i})" for i in range(12) for text in TARGETS]
VOCAB_SIZE = 800

ROUND_TRIP_TEXTS = [
    "Die Katze sitzt auf der Matte.",
    "Größe, Maße, Straße: ß und ä, ö, ü, Ä, Ö, Ü.",
    "Crème brûlée à la française, naïve café, Ångström, señor.",
    "Donaudampfschifffahrtsgesellschaftskapitän",
    "Pi ist 3.14, das sind 1,000 Punkte, um 20:15 Uhr; 1.000,50 € oder $5.",
    "東京は日本の首都です。中文也可以。한국어도.",
    "Emoji 😀🎉👍🏽 and flags 🇩🇪 and ZWJ 👩‍👩‍👧.",
    "\"Quoted,\" she said. 'Single quotes' and it's, don't, l'homme.",
    "„Deutsche Anführungszeichen“ und »Guillemets« ‚einfach‘.",
    "  leading and trailing spaces  ",
    "multiple   spaces\tand\ttabs\nand\nnewlines",
    "Punctuation!?.,;:-()[]{}<>/\\|@#%^&*_+=~`",
    "Decomposed: Cafe\u0301 vs precomposed Café",
    "Text with a literal </s> and <s> and <pad> and <unk> inside.",
    "",
    " ",
    "x",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_shared_bpe(CORPUS_SOURCES + CORPUS_TARGETS, vocab_size=VOCAB_SIZE)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_is_exact(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    target_ids = tokenizer(text_target=text).input_ids
    assert tokenizer.decode(target_ids, skip_special_tokens=True) == text
    # Byte-level BPE covers every byte, so nothing unseen in training becomes <unk>.
    assert tokenizer.unk_token_id not in ids


def test_special_token_ids_match_model_config(tokenizer: PreTrainedTokenizerFast) -> None:
    expected = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    assert tokenizer.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == tuple(expected)
    config = VaswaniConfig()
    assert tokenizer.pad_token_id == config.pad_token_id == 0
    assert tokenizer.bos_token_id == config.bos_token_id == config.decoder_start_token_id == 1
    assert tokenizer.eos_token_id == config.eos_token_id == 2
    assert tokenizer.unk_token_id == 3


def test_eos_appended_to_source_and_target_without_bos(tokenizer: PreTrainedTokenizerFast) -> None:
    source = tokenizer("Die Katze sitzt auf der Matte.").input_ids
    target = tokenizer(text_target="The cat sits on the mat.").input_ids
    both = tokenizer("Die Katze sitzt.", text_target="The cat sits.")
    for ids in (source, target, both["input_ids"], both["labels"]):
        assert ids[-1] == tokenizer.eos_token_id
        assert ids.count(tokenizer.eos_token_id) == 1
        assert tokenizer.bos_token_id not in ids
    assert tokenizer("").input_ids == [tokenizer.eos_token_id]


def test_literal_special_token_text_is_not_a_control_token(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("a </s> b <s>").input_ids
    assert ids.count(tokenizer.eos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.bos_token_id not in ids


def test_padding_uses_pad_id_zero(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = tokenizer(["a", "longer sentence"], padding=True, return_tensors="pt")
    short_length = len(tokenizer("a").input_ids)
    assert batch.input_ids.shape == (2, len(tokenizer("longer sentence").input_ids))
    assert torch.all(batch.input_ids[0, short_length:] == 0)
    assert batch.input_ids[0, short_length - 1] == tokenizer.eos_token_id
    assert batch.attention_mask[0].tolist() == [1] * short_length + [0] * (batch.input_ids.shape[1] - short_length)
    assert torch.all(batch.attention_mask[1] == 1)
    assert set(batch) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize(
    ("own_padding", "own_truncation"),
    [
        (None, None),
        ({"length": 32, "pad_id": 0, "pad_token": "<pad>"}, None),
        (None, {"max_length": 64, "stride": 0, "strategy": "only_first", "direction": "left"}),
    ],
    ids=["none", "own_padding", "own_truncation"],
)
def test_a_padded_encoding_leaves_the_tokenizer_as_it_was(
    tokenizer: PreTrainedTokenizerFast, own_padding: dict | None, own_truncation: dict | None, tmp_path: Path
) -> None:
    """transformers sets a call's padding on the backend and clears its truncation, and save_pretrained writes both."""
    backend = tokenizer.backend_tokenizer
    if own_padding is not None:
        backend.enable_padding(**own_padding)
    if own_truncation is not None:
        backend.enable_truncation(**own_truncation)
    try:
        tokenizer.save_pretrained(tmp_path / "before")
        before = (backend.padding, backend.truncation)
        batch = encode_padded(tokenizer, ["a", "longer sentence"])
        tokenizer.save_pretrained(tmp_path / "after")
        assert (backend.padding, backend.truncation) == before
        saved = [(tmp_path / folder / "tokenizer.json").read_text() for folder in ("before", "after")]
        assert saved[0] == saved[1]
        expected = tokenizer(["a", "longer sentence"], padding=True, return_tensors="pt")
        assert torch.equal(batch.input_ids, expected.input_ids)
        assert torch.equal(batch.attention_mask, expected.attention_mask)
    finally:
        backend.no_padding()
        backend.no_truncation()


def test_save_and_autotokenizer_load_round_trip(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    # Save next to a model config, as a checkpoint folder would be: the tokenizer class must still resolve.
    VaswaniConfig(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"  # transformers 5's name for PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.is_fast
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.all_special_tokens == tokenizer.all_special_tokens
    assert [loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id] == [0, 1, 2, 3]
    assert loaded.model_max_length == tokenizer.model_max_length >= 1_000_000
    texts = ROUND_TRIP_TEXTS[:-3]
    assert loaded(texts, padding=True).input_ids == tokenizer(texts, padding=True).input_ids
    assert loaded(text_target=texts).input_ids == tokenizer(text_target=texts).input_ids
    for text in texts:
        assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, VOCAB_SIZE])
def test_vocab_size_is_an_upper_bound(vocab_size: int) -> None:
    tokenizer = train_shared_bpe(CORPUS_SOURCES + CORPUS_TARGETS, vocab_size=vocab_size)
    assert len(tokenizer) <= vocab_size
    text = "Größe 😀 東京"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


def test_invalid_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_shared_bpe(["some text"], vocab_size=MIN_VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match="min_frequency"):
        train_shared_bpe(["some text"], vocab_size=1000, min_frequency=0)
    with pytest.raises(ValueError, match="single string"):
        train_shared_bpe("some text", vocab_size=1000)


def test_vocabulary_is_shared_between_source_and_target(tokenizer: PreTrainedTokenizerFast) -> None:
    assert not any("Zwetschgenkuchen" in text for text in CORPUS_SOURCES)
    ids = tokenizer("I like Zwetschgenkuchen").input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "ĠZwetschgenkuchen" in tokens  # Ġ is the byte-level symbol for the preceding space
    # Encoder and decoder sides use one id for it.
    target_ids = tokenizer(text_target="Ich mag Zwetschgenkuchen").input_ids
    assert tokenizer.convert_tokens_to_ids("ĠZwetschgenkuchen") in target_ids


def test_train_from_dataset_uses_both_columns(tokenizer: PreTrainedTokenizerFast) -> None:
    dataset = Dataset.from_dict({"source": CORPUS_SOURCES, "target": CORPUS_TARGETS, "id": list(range(96))})
    from_dataset = train_shared_bpe_from_dataset(dataset, vocab_size=VOCAB_SIZE, batch_size=10)
    # Same texts as the fixture, in a different order: BPE counts pairs, so the vocabulary is the same.
    assert from_dataset.get_vocab() == tokenizer.get_vocab()
    assert "ĠZwetschgenkuchen" in from_dataset.get_vocab()
    with pytest.raises(ValueError, match="column"):
        train_shared_bpe_from_dataset(dataset, columns=("source", "translation"), vocab_size=VOCAB_SIZE)
