"""Converted Marian and FSMT models compute the same logits and decode to the same outputs; what cannot convert is
refused; a converted folder loads and translates like its source, also where hf_vaswani is not installed."""

import io
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import run_without_hf_vaswani
from tiny import MARIAN_SMALL, tiny_marian
from torch import nn
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    FSMTConfig,
    FSMTForConditionalGeneration,
    FSMTTokenizer,
    MarianConfig,
    MarianMTModel,
    MarianTokenizer,
    PreTrainedModel,
)
from transformers.models.fsmt.modeling_fsmt import SinusoidalPositionalEmbedding as FSMTSinusoidalPositionalEmbedding
from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.interop.convert import convert_folder, from_fsmt, from_marian, interleave_permutation
from hf_vaswani.model.modeling_vaswani import VaswaniSinusoidalPositionalEncoding

# A different shape: three heads, one encoder layer against two decoder layers.
OTHER_SHAPE = {
    **MARIAN_SMALL,
    "d_model": 24,
    "encoder_attention_heads": 3,
    "decoder_attention_heads": 3,
    "encoder_layers": 1,
}


@dataclass
class Special:
    """The special ids a source model uses (Marian: eos 0, pad last and decoder start; FSMT: bos 0, pad 1, eos 2)."""

    pad: int
    eos: int
    start: int
    avoid: frozenset[int]  # ids never used as content tokens


FSMT = Special(pad=1, eos=2, start=2, avoid=frozenset({0, 1, 2, 3}))


def marian_special(pad: int) -> Special:
    return Special(pad=pad, eos=0, start=pad, avoid=frozenset({0, 1, pad}))


def content_ids(vocab_size: int, special: Special) -> list[int]:
    return [token for token in range(vocab_size) if token not in special.avoid]


def successor_batch(
    generator: torch.Generator, source_vocab: int, target_vocab: int, special: Special, size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A toy task a tiny model learns in a second: the target counts up from the first source token, as many tokens
    as the source has, then </s>. Returns right-padded source ids, decoder inputs and labels (-100 on padding)."""
    sources, targets = content_ids(source_vocab, special), content_ids(target_vocab, special)
    lengths = torch.randint(2, 7, (size,), generator=generator).tolist()
    width = max(lengths) + 1
    source = torch.full((size, width), special.pad)
    decoder_inputs = torch.full((size, width), special.pad)
    labels = torch.full((size, width), -100)
    for row, length in enumerate(lengths):
        tokens = [sources[i] for i in torch.randint(len(sources), (length,), generator=generator).tolist()]
        first = sources.index(tokens[0])
        target = [targets[(first + k) % len(targets)] for k in range(length)] + [special.eos]
        source[row, : length + 1] = torch.tensor([*tokens, special.eos])
        decoder_inputs[row, : length + 1] = torch.tensor([special.start, *target[:-1]])
        labels[row, : length + 1] = torch.tensor(target)
    return source, decoder_inputs, labels


def teach(
    model: PreTrainedModel, source_vocab: int, target_vocab: int, special: Special, steps: int = 80
) -> PreTrainedModel:
    """Random initialisations decode to one repeated token; a few Adam steps give varied outputs and varied lengths."""
    generator = torch.Generator().manual_seed(0)
    # FSMT's positional table is a trainable parameter: training it would make the source non-sinusoidal.
    parameters = [p for name, p in model.named_parameters() if "embed_positions" not in name]
    optimizer = torch.optim.Adam(parameters, lr=1e-2)
    model.train()
    for _ in range(steps):
        source, decoder_inputs, labels = successor_batch(generator, source_vocab, target_vocab, special)
        logits = model(
            input_ids=source,
            attention_mask=(source != special.pad).long(),
            decoder_input_ids=decoder_inputs,
            use_cache=False,
        ).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@dataclass
class Case:
    kind: str  # "marian" or "fsmt"
    config: dict
    logits_bias: bool  # Marian: fill final_logits_bias with randn
    expected: dict  # VaswaniConfig fields the conversion must produce


CASES = {
    "marian-shared-tied-bias-scaled": Case(
        "marian",
        dict(
            **MARIAN_SMALL,
            vocab_size=30,
            pad_token_id=29,
            decoder_start_token_id=29,
            eos_token_id=0,
            scale_embedding=True,
        ),
        True,
        dict(share_embeddings=True, tie_word_embeddings=True, vocab_size=30, source_vocab_size=30, output_bias=True),
    ),
    "marian-separate-tied": Case(
        "marian",
        dict(
            **OTHER_SHAPE,
            vocab_size=30,
            decoder_vocab_size=25,
            share_encoder_decoder_embeddings=False,
            pad_token_id=24,
            decoder_start_token_id=24,
            eos_token_id=0,
        ),
        False,
        dict(share_embeddings=False, tie_word_embeddings=True, vocab_size=25, source_vocab_size=30, encoder_layers=1),
    ),
    "marian-separate-untied-bias": Case(
        "marian",
        dict(
            **MARIAN_SMALL,
            vocab_size=30,
            decoder_vocab_size=25,
            share_encoder_decoder_embeddings=False,
            tie_word_embeddings=False,
            pad_token_id=24,
            decoder_start_token_id=24,
            eos_token_id=0,
        ),
        True,
        dict(share_embeddings=False, tie_word_embeddings=False, vocab_size=25, source_vocab_size=30),
    ),
    # transformers' Marian unties the encoder and decoder embeddings too when tie_word_embeddings=False.
    "marian-shared-untied": Case(
        "marian",
        dict(**MARIAN_SMALL, vocab_size=30, pad_token_id=29, decoder_start_token_id=29, eos_token_id=0)
        | {"tie_word_embeddings": False},
        False,
        dict(share_embeddings=False, tie_word_embeddings=False, vocab_size=30, source_vocab_size=30),
    ),
    "fsmt-separate-untied": Case(
        "fsmt",
        dict(**MARIAN_SMALL, langs=["en", "de"], src_vocab_size=30, tgt_vocab_size=25),
        False,
        dict(share_embeddings=False, tie_word_embeddings=False, vocab_size=25, source_vocab_size=30, output_bias=False),
    ),
    # FSMT with tie_word_embeddings=True replaces the encoder embedding by the decoder's: one 25-token vocabulary.
    "fsmt-tied": Case(
        "fsmt",
        dict(**OTHER_SHAPE, langs=["en", "de"], src_vocab_size=30, tgt_vocab_size=25, tie_word_embeddings=True),
        False,
        dict(share_embeddings=True, tie_word_embeddings=True, vocab_size=25, source_vocab_size=25),
    ),
    "fsmt-same-size-unscaled": Case(
        "fsmt",
        dict(**MARIAN_SMALL, langs=["en", "de"], src_vocab_size=28, tgt_vocab_size=28, scale_embedding=False),
        False,
        dict(share_embeddings=False, tie_word_embeddings=False, scale_embedding=False, vocab_size=28),
    ),
}


def build_source(case: Case) -> tuple[PreTrainedModel, Special]:
    torch.manual_seed(0)
    if case.kind == "marian":
        model = MarianMTModel(MarianConfig(**case.config))
        special = marian_special(model.config.pad_token_id)
        if case.logits_bias:
            model.final_logits_bias.normal_()
    else:
        model = FSMTForConditionalGeneration(FSMTConfig(**case.config))
        special = FSMT
    source_vocab = model.get_input_embeddings().weight.shape[0]
    target_vocab = model.config.decoder_vocab_size if case.kind == "marian" else model.config.tgt_vocab_size
    return teach(model, source_vocab, target_vocab, special), special


def comparison_batch(source_vocab: int, target_vocab: int, special: Special) -> dict[str, torch.Tensor]:
    """Three right-padded sentences of different lengths with right-padded teacher-forcing inputs."""
    generator = torch.Generator().manual_seed(7)
    source, decoder_inputs, _ = successor_batch(generator, source_vocab, target_vocab, special, size=3)
    return {"input_ids": source, "attention_mask": (source != special.pad).long(), "decoder_input_ids": decoder_inputs}


def max_logit_difference(source: PreTrainedModel, converted: VaswaniForConditionalGeneration, batch: dict) -> float:
    """Largest |difference| of the logits over the decoder's non-padding positions."""
    with torch.no_grad():
        # use_cache=False: FSMT's forward applies its causal mask only then
        expected = source(**batch, use_cache=False).logits
        actual = converted(**batch).logits
    source_lengths = batch["attention_mask"].sum(-1, keepdim=True)
    # decoder inputs are (start, target[:-1]), as long as their source sentence plus </s>
    real = torch.arange(batch["decoder_input_ids"].shape[1]) < source_lengths
    return (expected - actual).abs()[real].max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_conversion_keeps_logits_and_decoding(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    source, special = build_source(case)
    convert = from_marian if case.kind == "marian" else from_fsmt
    converted = convert(source).eval()
    for field, value in case.expected.items():
        assert getattr(converted.config, field) == value, field
    assert converted.config.positional_encoding == ("sinusoidal" if case.kind == "marian" else "fairseq_sinusoidal")

    source_vocab, target_vocab = converted.config.source_vocab_size, converted.config.vocab_size
    batch = comparison_batch(source_vocab, target_vocab, special)
    assert max_logit_difference(source, converted, batch) < 1e-4

    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    greedy = source.generate(**inputs, num_beams=1, do_sample=False, max_new_tokens=10)
    assert torch.equal(converted.generate(**inputs, num_beams=1, do_sample=False, max_new_tokens=10), greedy)
    # not a degenerate model: several distinct tokens, and sentences ending at different lengths
    assert len(set(greedy[:, 1:].flatten().tolist()) - {special.pad, special.eos}) >= 3
    assert len({int((row == special.eos).nonzero()[-1]) for row in greedy[:, 1:]}) >= 2

    beam = dict(num_beams=3, num_return_sequences=3, length_penalty=0.7, max_new_tokens=10)
    expected = source.generate(**inputs, **beam, output_scores=True, return_dict_in_generate=True)
    actual = converted.generate(**inputs, **beam, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(actual.sequences, expected.sequences)
    torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=0)

    # The copied generation config alone (FSMT's: 5 beams, power length penalty 1.0) decodes the same.
    assert converted.generation_config.length_penalty_type == "power"
    assert converted.generation_config.max_new_tokens_over_source is None
    default = source.generate(**inputs, max_new_tokens=10)
    assert torch.equal(converted.generate(**inputs, max_new_tokens=10), default)

    # Ties, vocabularies, positions and the generation config survive saving.
    converted.save_pretrained(tmp_path)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, VaswaniForConditionalGeneration)
    for field, value in case.expected.items():
        assert getattr(reloaded.config, field) == value, field
    assert max_logit_difference(source, reloaded, batch) < 1e-4
    assert torch.equal(reloaded.generate(**inputs, max_new_tokens=10), default)


def test_permutation_turns_halves_into_interleaved_sinusoids() -> None:
    assert interleave_permutation(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    positions = torch.arange(40)
    # transformers' own tables as the reference: Marian's from position 0, FSMT's from padding_idx + 1
    marian = MarianSinusoidalPositionalEmbedding(40, 16).create_weight()
    fsmt = FSMTSinusoidalPositionalEmbedding.get_embedding(42, 16, padding_idx=1)[2:]
    for fairseq, first, theirs in ((False, 0, marian), (True, 2, fsmt)):
        ours = VaswaniSinusoidalPositionalEncoding(16, fairseq=fairseq, first_position=first)(positions)
        torch.testing.assert_close(theirs.float()[:, interleave_permutation(16)], ours, atol=1e-5, rtol=0)


def tiny_fsmt(**overrides) -> FSMTForConditionalGeneration:
    settings = {**MARIAN_SMALL, "langs": ["en", "de"], "src_vocab_size": 30, "tgt_vocab_size": 25}
    return FSMTForConditionalGeneration(FSMTConfig(**{**settings, **overrides})).eval()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tiny_marian(activation_function="swish"), "swish"),
        (lambda: tiny_fsmt(activation_function="gelu"), "gelu"),
        (lambda: tiny_marian(decoder_attention_heads=4), "attention heads"),
        (lambda: tiny_fsmt(encoder_ffn_dim=32), "feed-forward"),
        (lambda: tiny_marian(d_model=15, encoder_attention_heads=3, decoder_attention_heads=3), "odd d_model"),
        (lambda: tiny_marian(normalize_before=True), "normalize_before"),
        (lambda: tiny_marian(normalize_embedding=True), "normalize_embedding"),
        (lambda: tiny_fsmt(layernorm_embedding=True), "layernorm_embedding"),
        (lambda: tiny_marian(add_final_layer_norm=True), "add_final_layer_norm"),
        (lambda: tiny_marian(static_position_embeddings=False), "static_position_embeddings"),
    ],
)
def test_refuses_config_the_paper_cannot_express(build: Callable[[], PreTrainedModel], message: str) -> None:
    model = build()
    convert = from_marian if isinstance(model, MarianMTModel) else from_fsmt
    with pytest.raises(ValueError, match=message):
        convert(model)


def test_refuses_non_sinusoidal_positions_and_unknown_parameters() -> None:
    marian = tiny_marian()
    with torch.no_grad():
        marian.model.decoder.embed_positions.weight.add_(0.1)  # as if the positions had been learned
    with pytest.raises(ValueError, match="non-sinusoidal positions"):
        from_marian(marian)

    fsmt = tiny_fsmt()
    with torch.no_grad():
        fsmt.model.encoder.embed_positions.weight[5].add_(0.1)
    with pytest.raises(ValueError, match="non-sinusoidal positions"):
        from_fsmt(fsmt)

    marian = tiny_marian()
    marian.model.encoder.layernorm_embedding = nn.LayerNorm(16)  # a module the config does not announce
    with pytest.raises(ValueError, match=r"model\.encoder\.layernorm_embedding\.weight"):
        from_marian(marian)

    with pytest.raises(TypeError):
        from_marian(tiny_fsmt())  # type: ignore[arg-type]


# A handful of sentences: enough for tiny sentencepiece models.
SOURCE_TEXTS = [
    "the red cat sat on the mat",
    "a blue dog runs in the park",
    "the sun is bright today",
    "green trees grow near the river",
    "my house has a red door",
    "the moon shines at night",
]
TARGET_TEXTS = [
    "die rote katze sass auf der matte",
    "ein blauer hund rennt im park",
    "die sonne ist heute hell",
    "gruene baeume wachsen am fluss",
    "mein haus hat eine rote tuer",
    "der mond scheint in der nacht",
]
TRANSLATE = ["the red cat sat on the mat", "a blue dog", "green trees near my house"]


def write_marian_tokenizer(folder: Path) -> None:
    """source.spm, target.spm and a joint vocab.json (</s> = 0, <unk> = 1, <pad> last), as OPUS-MT folders have."""
    sentencepiece = pytest.importorskip("sentencepiece")
    pieces: list[str] = []
    for texts, name in ((SOURCE_TEXTS, "source.spm"), (TARGET_TEXTS, "target.spm")):
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts * 3),
            model_writer=model,
            vocab_size=40,
            hard_vocab_limit=False,
            character_coverage=1.0,
            minloglevel=2,
        )
        (folder / name).write_bytes(model.getvalue())
        processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
        for i in range(processor.get_piece_size()):
            piece = processor.id_to_piece(i)
            if not (processor.is_control(i) or processor.is_unknown(i)) and piece not in pieces:
                pieces.append(piece)
    vocab = {"</s>": 0, "<unk>": 1, **{piece: i + 2 for i, piece in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))


def translate(folder: Path, texts: list[str], **kwargs) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, **kwargs).eval()
    generated = model.generate(**tokenizer(texts, return_tensors="pt", padding=True))
    return tokenizer.batch_decode(generated, skip_special_tokens=True)


LOAD_CONVERTED = """
import json, sys

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

folder, texts = sys.argv[1], json.loads(sys.argv[2])
# trust_remote_code for the tokenizer too: AutoTokenizer reads the model config, whose class is remote code here.
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
generated = model.generate(**tokenizer(texts, return_tensors="pt", padding=True))
translator = pipeline("translation", model=folder, trust_remote_code=True)
print(json.dumps({"generate": tokenizer.batch_decode(generated, skip_special_tokens=True),
                  "pipeline": [result["translation_text"] for result in translator(texts)],
                  "model_module": type(model).__module__}))
"""


def test_convert_folder_round_trip_with_marian_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source_dir = tmp_path / "opus-mt-tiny"
    source_dir.mkdir()
    write_marian_tokenizer(source_dir)
    files = [str(source_dir / name) for name in ("source.spm", "target.spm", "vocab.json")]
    tokenizer = MarianTokenizer(*files, source_lang="en", target_lang="de")
    torch.manual_seed(0)
    pad = tokenizer.pad_token_id
    config = dict(MARIAN_SMALL, vocab_size=len(tokenizer), pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0)
    model = MarianMTModel(MarianConfig(**config, scale_embedding=True))
    model.final_logits_bias.normal_(std=0.1)
    teach(model, len(tokenizer), len(tokenizer), marian_special(pad))
    # as OPUS-MT generation configs do
    model.generation_config.update(num_beams=3, max_length=24, bad_words_ids=[[pad]])
    model.save_pretrained(source_dir)
    tokenizer.save_pretrained(source_dir)

    with pytest.raises(ValueError, match="marian"):
        convert_folder("fsmt", source_dir, tmp_path / "wrong")
    main(["convert", "--from", "marian", str(source_dir), str(tmp_path / "converted")])  # the `vaswani convert` CLI
    output_dir = tmp_path / "converted"
    assert {"source.spm", "target.spm", "vocab.json", "modeling_vaswani.py"} <= {p.name for p in output_dir.iterdir()}

    expected = translate(source_dir, TRANSLATE)
    assert all(text.strip() for text in expected)
    assert translate(output_dir, TRANSLATE) == expected
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    assert isinstance(reloaded, VaswaniForConditionalGeneration)
    assert reloaded.generation_config.bad_words_ids == [[pad]]
    assert reloaded.generation_config.num_beams == 3
    assert reloaded.generation_config.length_penalty_type == "power"

    report = run_without_hf_vaswani(LOAD_CONVERTED, [str(output_dir), json.dumps(TRANSLATE)], tmp_path)
    assert report["model_module"].startswith("transformers_modules")
    assert report["generate"] == expected
    assert report["pipeline"] == expected

    # A tokenizer that cannot save itself is copied file by file instead.
    def refuse_to_save(self, *args, **kwargs):
        raise OSError("this tokenizer cannot save itself")

    monkeypatch.setattr(MarianTokenizer, "save_pretrained", refuse_to_save)
    copied = convert_folder("marian", source_dir, tmp_path / "copied-tokenizer")
    assert {"source.spm", "target.spm", "vocab.json", "tokenizer_config.json"} <= {p.name for p in copied.iterdir()}
    assert translate(copied, TRANSLATE) == expected


def write_fsmt_tokenizer(folder: Path, source_letters: str, target_letters: str) -> FSMTTokenizer:
    """A character-level fairseq BPE (no merges): every letter, alone and word-final."""
    special = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for letters, name in ((source_letters, "vocab-src.json"), (target_letters, "vocab-tgt.json")):
        pieces = [piece for letter in letters for piece in (letter, letter + "</w>")]
        vocab = {**special, **{piece: i + len(special) for i, piece in enumerate(pieces)}}
        (folder / name).write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("")
    return FSMTTokenizer(
        langs=["en", "de"],
        src_vocab_file=str(folder / "vocab-src.json"),
        tgt_vocab_file=str(folder / "vocab-tgt.json"),
        merges_file=str(folder / "merges.txt"),
    )


def test_convert_folder_fsmt(tmp_path: Path) -> None:
    source_dir = tmp_path / "wmt-tiny"
    source_dir.mkdir()
    tokenizer = write_fsmt_tokenizer(source_dir, string.ascii_lowercase, string.ascii_lowercase[:12])
    source_vocab, target_vocab = tokenizer.src_vocab_size, tokenizer.tgt_vocab_size
    torch.manual_seed(0)
    model = FSMTForConditionalGeneration(
        FSMTConfig(**MARIAN_SMALL, langs=["en", "de"], src_vocab_size=source_vocab, tgt_vocab_size=target_vocab)
    )
    teach(model, source_vocab, target_vocab, FSMT)
    model.generation_config.update(max_length=16)
    model.save_pretrained(source_dir)
    tokenizer.save_pretrained(source_dir)

    output_dir = convert_folder("fsmt", source_dir, tmp_path / "converted")
    expected = translate(source_dir, TRANSLATE)
    assert translate(output_dir, TRANSLATE) == expected
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    assert reloaded.config.positional_encoding == "fairseq_sinusoidal"
    assert (reloaded.config.source_vocab_size, reloaded.config.vocab_size) == (source_vocab, target_vocab)
