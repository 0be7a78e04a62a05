"""Export to MarianMTModel and CTranslate2: the same function, checked against HF's MarianMTModel and CTranslate2's own
decoding and scoring; whatever cannot be expressed is refused by name."""

import json

import pytest
import torch
from helpers import refused
from tiny import PROBE_SENTENCES, UNEVEN_MODEL, random_model

from hf_vaswani import VaswaniForConditionalGeneration, save_model_folder
from hf_vaswani.cli import main
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.interop.export import export_ctranslate2, to_marian, write_ctranslate2

ctranslate2 = pytest.importorskip("ctranslate2")

# Greedy decoding is compared token for token, so every step must be decided by much more than float rounding
# (~1e-5 between torch and CTranslate2 here): the suite's toy model (conftest's trained_folder) is trained until its
# right-vs-best-wrong logit margin on the probe sentences is helpers.LOGIT_MARGIN, and greedy's top-1 vs top-2 gap along
# its output, asserted below, must be at least this.
CONFIDENT_LOGIT_GAP = 1.0
MAX_NEW_TOKENS = 12


def greedy_with_gap(model, tokenizer, sentences: list[str]) -> tuple[list[list[int]], float]:
    """Our greedy outputs (without the start token) and the smallest top-1 vs top-2 logit gap over all their steps."""
    outputs, gap = [], torch.inf
    for sentence in sentences:
        result = model.generate(
            **tokenizer([sentence], return_tensors="pt"),
            num_beams=1,
            max_new_tokens=MAX_NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
        top2 = torch.cat(result.logits).topk(2, dim=-1).values
        gap = min(gap, (top2[:, 0] - top2[:, 1]).min().item())
        outputs.append(result.sequences[0, 1:].tolist())
    return outputs, gap


@pytest.fixture(scope="module")
def trained(trained_folder):
    """The suite's toy model, trained until every probe sentence translates to its capitals (conftest.py)."""
    model, tokenizer = load_model_folder(trained_folder)
    return model, tokenizer, trained_folder


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    model, tokenizer, folder = trained
    return export_ctranslate2(folder, tmp_path_factory.mktemp("ct2") / "float32")


def ct2_tokens(tokenizer, sentences: list[str]) -> list[list[str]]:
    return [tokenizer.convert_ids_to_tokens(tokenizer(sentence)["input_ids"]) for sentence in sentences]


def test_ctranslate2_greedy_equals_ours_token_for_token(trained, exported):
    model, tokenizer, _ = trained
    ours, gap = greedy_with_gap(model, tokenizer, PROBE_SENTENCES)
    assert gap >= CONFIDENT_LOGIT_GAP
    translator = ctranslate2.Translator(str(exported), intra_threads=1)
    results = translator.translate_batch(
        ct2_tokens(tokenizer, PROBE_SENTENCES), beam_size=1, max_decoding_length=MAX_NEW_TOKENS, return_end_token=True
    )
    assert [tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results] == ours


def test_ctranslate2_beam_search_agrees_with_transformers_length_penalty(trained, exported):
    """CTranslate2's length penalty is transformers' score / length^alpha, so beams agree with length_penalty_type
    "power" (the paper's GNMT penalty has no CTranslate2 counterpart)."""
    model, tokenizer, _ = trained
    sentences = PROBE_SENTENCES
    ours = model.generate(
        **tokenizer(sentences, return_tensors="pt", padding=True),
        num_beams=4,
        length_penalty=0.6,
        length_penalty_type="power",
        max_new_tokens=MAX_NEW_TOKENS,
    )
    translator = ctranslate2.Translator(str(exported), intra_threads=1)
    results = translator.translate_batch(
        ct2_tokens(tokenizer, sentences), beam_size=4, length_penalty=0.6, max_decoding_length=MAX_NEW_TOKENS
    )
    theirs = [tokenizer.convert_tokens_to_string(result.hypotheses[0]) for result in results]
    assert theirs == tokenizer.batch_decode(ours, skip_special_tokens=True)


def test_exported_folder_holds_our_tokenizer_and_vocabulary(trained, exported):
    _, tokenizer, _ = trained
    from transformers import AutoTokenizer

    assert (
        AutoTokenizer.from_pretrained(exported)(PROBE_SENTENCES[0])["input_ids"]
        == tokenizer(PROBE_SENTENCES[0])["input_ids"]
    )
    vocabulary = json.loads((exported / "shared_vocabulary.json").read_text())
    assert vocabulary == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))


VARIANTS = {
    "paper": {},
    "untied, unshared, output bias, unscaled, eps 1e-5": dict(
        share_embeddings=False, tie_word_embeddings=False, output_bias=True, scale_embedding=False, layer_norm_eps=1e-5
    ),
}


def perturbed_model(**overrides) -> VaswaniForConditionalGeneration:
    """An untrained UNEVEN_MODEL over a vocabulary of 300, every weight moved off its initial value."""
    model = random_model(0, UNEVEN_MODEL, vocab_size=300, **overrides)
    with torch.no_grad():
        for parameter in model.parameters():  # larger, non-zero weights (biases and LayerNorms included)
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return model


def logit_tolerance(logits: torch.Tensor) -> float:
    # fp32 rounding through a few layers: ~1e-6 relative per operation, a few hundred operations deep.
    return 1e-4 * max(1.0, logits.abs().max().item())


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_to_marian_gives_our_logits(overrides):
    model = perturbed_model(**overrides)
    marian = to_marian(model).eval()
    input_ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # padding
    decoder_input_ids = torch.randint(3, 300, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        theirs = marian(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    assert ours.abs().max() > 1.0  # a non-trivial function
    torch.testing.assert_close(theirs, ours, atol=logit_tolerance(ours), rtol=0)


def word_tokenizer(size: int):
    """A tokenizer with exactly `size` tokens, whose specials are ours (<pad> 0, <s> 1, </s> 2, <unk> 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocabulary = {token: index for index, token in enumerate(specials + [f"w{i}" for i in range(size - 4)])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_ctranslate2_scores_equal_our_log_probabilities(overrides, tmp_path):
    """Forced decoding compares every position's distribution, free of greedy near-ties on random weights."""
    model = perturbed_model(**overrides)
    tokenizer = word_tokenizer(300)
    output = write_ctranslate2(model, tokenizer, tmp_path / "ct2")
    generator = torch.Generator().manual_seed(3)
    sources = [[*torch.randint(4, 300, (length,), generator=generator).tolist(), 2] for length in (5, 9)]
    targets = [[*torch.randint(4, 300, (length,), generator=generator).tolist(), 2] for length in (4, 6)]
    translator = ctranslate2.Translator(str(output), intra_threads=1)
    results = translator.score_batch(
        [tokenizer.convert_ids_to_tokens(source) for source in sources],
        [tokenizer.convert_ids_to_tokens(target[:-1]) for target in targets],  # it appends </s> itself
    )
    for source, target, result in zip(sources, targets, results, strict=True):
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([[1, *target[:-1]]])
            ).logits[0]
        ours = logits.log_softmax(-1).gather(-1, torch.tensor(target)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.log_probs), ours, atol=logit_tolerance(logits), rtol=0)


REFUSALS = {
    "positional_encoding='learned'": dict(positional_encoding="learned"),
    "positional_encoding='fairseq_sinusoidal'": dict(positional_encoding="fairseq_sinusoidal"),
    "d_k=4": dict(d_k=4),
    "d_v=16": dict(d_v=16),
}


@pytest.mark.parametrize(("named", "overrides"), REFUSALS.items(), ids=REFUSALS.keys())
def test_inexpressible_models_are_refused_by_name(named, overrides):
    with pytest.raises(ValueError, match="cannot export") as refused:
        to_marian(perturbed_model(**overrides))
    assert named in str(refused.value)


def test_other_vocabularies_are_refused(tmp_path):
    with pytest.raises(ValueError, match="source_vocab_size=200 != vocab_size=300"):
        write_ctranslate2(perturbed_model(share_embeddings=False, source_vocab_size=200), word_tokenizer(300), tmp_path)
    with pytest.raises(ValueError, match="the tokenizer has 290 distinct tokens"):
        write_ctranslate2(perturbed_model(), word_tokenizer(290), tmp_path)
    with pytest.raises(ValueError, match="quantization must be one of"):
        write_ctranslate2(perturbed_model(), word_tokenizer(300), tmp_path, quantization="int4")
    (tmp_path / "kept.txt").write_text("")
    with pytest.raises(ValueError, match="already exists"):
        write_ctranslate2(perturbed_model(), word_tokenizer(300), tmp_path)


def test_cli_exports_and_refuses_in_one_line(trained, tmp_path, capfd):
    model, tokenizer, folder = trained
    main(["export", "--to", "ctranslate2", str(folder), str(tmp_path / "out"), "--quantization", "int8"])
    printed = capfd.readouterr()
    assert printed.out == f"{tmp_path / 'out'}\n"
    assert "beam_size=4, length_penalty=0.6" in printed.err and "not the paper's GNMT" in printed.err
    assert (tmp_path / "out" / "model.bin").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()

    learned = tmp_path / "learned"
    save_model_folder(perturbed_model(positional_encoding="learned"), word_tokenizer(300), learned)
    capfd.readouterr()  # what saving printed (a progress bar)
    for argv, named in (
        (["export", "--to", "ctranslate2", str(learned), str(tmp_path / "new")], "positional_encoding='learned'"),
        (["export", "--to", "ctranslate2", str(folder), str(tmp_path / "out")], "already exists"),
        (["export", "--to", "ctranslate2", str(folder), str(tmp_path / "q"), "--quantization", "int4"], "int4"),
    ):
        refused(capfd, argv, named)
    assert not (tmp_path / "new").exists() and not (tmp_path / "q").exists()
