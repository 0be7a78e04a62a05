"""Decoding as in §6.1 (GNMT length penalty, source length + 50) and transformers' other decoding paths."""

import itertools
import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import (
    DECODING_PATHS,
    EOS,
    best,
    exhaustive_scores,
    offset_eos_logit,
    peaked_model,
    run_without_hf_vaswani,
    strip,
)
from tiny import PROBE_SENTENCES, SENTENCES_TESTS_TRANSLATE
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    pipeline,
)
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
)
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import hf_vaswani  # noqa: F401
from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.model.generation_vaswani import (
    BannedColumnsLogitsProcessor,
    PaperDecodingMixin,
    paper_generation_config,
)


def test_beam_search_picks_what_the_gnmt_formula_picks_including_where_transformers_form_differs() -> None:
    max_new = 3
    disagreements = 0
    for seed, eos_boost, alpha in [(4, 4.0, 1.0), (5, 1.0, 1.0), (0, 0.0, 0.6), (1, 2.0, 0.6), (2, 3.0, 0.6)]:
        model = peaked_model(seed)
        offset_eos_logit(model, eos_boost)  # makes stopping early a real contender
        source = torch.tensor([[3, 4, 5, EOS]])
        scores = exhaustive_scores([model], source, max_new, alpha)
        gnmt_best, gnmt_margin = best(scores, "gnmt")
        power_best, power_margin = best(scores, "power")
        if min(gnmt_margin, power_margin) < 1e-4:
            continue  # a near tie: float rounding could pick either
        # With as many beams as there are prefixes, beam search is exhaustive: it must return the formula's argmax.
        common = dict(
            num_beams=5**max_new,
            max_new_tokens=max_new,
            early_stopping="never",
            length_penalty=alpha,
            max_new_tokens_over_source=None,
            do_sample=False,
        )
        assert strip(model.generate(source, **common)[0]) == gnmt_best, (seed, eos_boost, alpha)
        assert strip(model.generate(source, length_penalty_type="power", **common)[0]) == power_best, seed
        disagreements += gnmt_best != power_best
    assert disagreements >= 1, "no case where the two penalties choose differently: the test would prove nothing"


def test_the_gnmt_penalty_of_a_call_comes_from_its_argument_its_generation_config_or_the_models() -> None:
    """Each way a call can set alpha gives GNMT's score (§6.1) of the formula's best output, and `generate` leaves
    nothing on the model: the penalty's form travels with the call."""
    model = peaked_model(1)
    offset_eos_logit(model, 2.0)
    source = torch.tensor([[3, 4, 5, EOS]])
    gnmt_best, _ = best(scores := exhaustive_scores([model], source, 3, 0.6), "gnmt")
    search = dict(num_beams=5**3, max_new_tokens=3, early_stopping="never", do_sample=False)
    returned = dict(output_scores=True, return_dict_in_generate=True, max_new_tokens_over_source=None)
    attributes = set(vars(model))
    outputs = [model.generate(source, length_penalty=0.6, **search, **returned)]
    outputs.append(model.generate(source, generation_config=GenerationConfig(length_penalty=0.6, **search, **returned)))
    model.generation_config.length_penalty = 0.6
    outputs.append(model.generate(source, **search, **returned))
    for out in outputs:
        assert strip(out.sequences[0]) == gnmt_best
        assert out.sequences_scores[0].item() == pytest.approx(scores[gnmt_best]["gnmt"], rel=1e-4)
    assert set(vars(model)) == attributes
    assert model.generation_config.length_penalty == 0.6 and type(model.generation_config.length_penalty) is float


def test_greedy_decoding_with_the_papers_config_does_not_warn_about_its_length_penalty() -> None:
    """The GNMT penalty is handed on only to beam search: transformers warns of a length penalty set for greedy."""
    model = peaked_model(0, vocab_size=20)
    model.generation_config = paper_generation_config(model.config)  # beam 4, alpha 0.6
    transformers_logging.warning_once.cache_clear()  # the warning is logged once per process
    with CaptureLogger(transformers_logging.get_logger("transformers.generation.configuration_utils")) as captured:
        model.generate(torch.tensor([[5, 6, EOS]]), num_beams=1, max_new_tokens=3)
    assert "length_penalty" not in captured.out


def test_each_sentence_stops_at_its_own_source_length_plus_50() -> None:
    model = peaked_model(0, vocab_size=20)
    model.generation_config = paper_generation_config(model.config)  # as `vaswani train` gives its models
    offset_eos_logit(model, -1000.0)  # never ends on its own
    assert model.generation_config.max_new_tokens_over_source == 50
    source = torch.tensor([[5, 6, EOS, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10, EOS]])
    mask = (torch.arange(7) < torch.tensor([[3], [7]])).long()
    for num_beams in (1, 4):
        out = model.generate(input_ids=source, attention_mask=mask, num_beams=num_beams)
        lengths = [len(strip(row)) for row in out]
        assert lengths == [3 + 50, 7 + 50], (num_beams, lengths)
        assert all(strip(row)[-1] == EOS for row in out)


def test_the_papers_generation_config_is_saved_and_loaded(tmp_path) -> None:
    model = peaked_model(0)
    model.generation_config = paper_generation_config(model.config)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["num_beams"] == 4 and saved["length_penalty"] == 0.6 and saved["early_stopping"] is True
    assert saved["length_penalty_type"] == "gnmt" and saved["max_new_tokens_over_source"] == 50
    assert VaswaniForConditionalGeneration.from_pretrained(tmp_path).generation_config.num_beams == 4


@pytest.fixture(scope="module")
def capitaliser(trained_folder):
    return AutoModelForSeq2SeqLM.from_pretrained(trained_folder), AutoTokenizer.from_pretrained(trained_folder)


# The trained fixture is checked to translate these, and every sentence this file translates, to their capitals
# (tiny.SENTENCES_TESTS_TRANSLATE): the literal translations below are that checked property, not the outcome of one
# machine's training run.
SENTENCES = SENTENCES_TESTS_TRANSLATE[:3]


def test_trained_model_translates_with_every_decoding_path(capitaliser) -> None:
    """The saved folder, reloaded, decodes the probe set as the trained model was checked to: every path agrees."""
    model, tokenizer = capitaliser
    batch = tokenizer(PROBE_SENTENCES, return_tensors="pt", padding=True)
    translations = {
        name: tokenizer.batch_decode(model.generate(**batch, **options), skip_special_tokens=True)
        for name, options in DECODING_PATHS.items()
    }
    assert translations["greedy"] == [s.upper() for s in PROBE_SENTENCES]
    assert translations["beam 4"] == translations["default"] == translations["greedy"]

    # generate's other outputs, on a smaller batch: their shapes, and scores consistent with the tokens chosen
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    sampled = model.generate(**batch, do_sample=True, num_beams=1, top_k=5, num_return_sequences=3)
    assert sampled.shape[0] == 9
    beams = model.generate(
        **batch, num_beams=4, num_return_sequences=2, return_dict_in_generate=True, output_scores=True
    )
    assert beams.sequences.shape[0] == 6 and beams.sequences_scores.shape == (6,)
    assert torch.all(beams.sequences_scores[0::2] >= beams.sequences_scores[1::2])
    greedy = model.generate(**batch, num_beams=1, return_dict_in_generate=True, output_scores=True)
    assert len(greedy.scores) == greedy.sequences.shape[1] - 1
    chosen = torch.stack(greedy.scores, 1).argmax(-1)
    # after a row's </s> transformers pads it, so compare the steps up to the first </s>
    for row in range(len(SENTENCES)):
        length = len(strip(greedy.sequences[row]))
        assert torch.equal(chosen[row, :length], greedy.sequences[row, 1 : 1 + length])


def test_cross_attentions_come_back_as_alignments(capitaliser) -> None:
    model, tokenizer = capitaliser
    model.set_attn_implementation("eager")
    try:
        batch = tokenizer(["red cat sun"], return_tensors="pt")
        out = model.generate(**batch, num_beams=1, return_dict_in_generate=True, output_attentions=True)
        steps = len(out.cross_attentions)
        assert steps == out.sequences.shape[1] - 1
        layer_last = out.cross_attentions[0][-1]
        assert layer_last.shape == (1, model.config.num_heads, 1, batch["input_ids"].shape[1])
        torch.testing.assert_close(layer_last.sum(-1), torch.ones(1, model.config.num_heads, 1))
    finally:
        model.set_attn_implementation("sdpa")


def test_padded_batch_decodes_like_one_by_one(capitaliser) -> None:
    model, tokenizer = capitaliser
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    together = tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True)
    alone = [
        tokenizer.decode(model.generate(**tokenizer([s], return_tensors="pt"))[0], skip_special_tokens=True)
        for s in SENTENCES
    ]
    assert together == alone


@pytest.mark.parametrize("num_beams", [1, 4])
def test_static_cache_gives_the_same_output(capitaliser, num_beams: int) -> None:
    model, tokenizer = capitaliser
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    dynamic = model.generate(**batch, num_beams=num_beams)
    static = model.generate(**batch, num_beams=num_beams, cache_implementation="static")
    assert torch.equal(dynamic, static)


def test_compiled_decoding_step_gives_the_same_output(capitaliser) -> None:
    model, tokenizer = capitaliser
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    reference = model.generate(**batch, num_beams=1, cache_implementation="static")
    original = model.forward
    try:
        model.forward = torch.compile(original, backend="aot_eager", dynamic=True)
        compiled = model.generate(**batch, num_beams=1, cache_implementation="static")
    finally:
        model.forward = original
    assert torch.equal(reference, compiled)


LOAD_PIPELINE = """
import json, sys

from transformers import pipeline

translator = pipeline("translation", model=sys.argv[1], trust_remote_code=True)
print(json.dumps({"one": translator("red cat sun"), "many": translator(["green tree", "blue dog"]),
                  "class": type(translator).__module__}))
"""


def test_translation_pipeline_from_a_saved_folder_without_hf_vaswani(tmp_path, trained_folder) -> None:
    report = run_without_hf_vaswani(LOAD_PIPELINE, [str(trained_folder)], tmp_path)
    assert report["class"].startswith("transformers_modules")
    # Another process, with its own thread count and kernels: the fixture's logit margin absorbs the rounding.
    assert report["one"] == [{"translation_text": "RED CAT SUN"}]
    assert report["many"] == [{"translation_text": "GREEN TREE"}, {"translation_text": "BLUE DOG"}]


def test_in_process_pipeline_with_generation_arguments(trained_folder) -> None:
    translator = pipeline("translation", model=str(trained_folder), trust_remote_code=True)
    assert translator("moon river", num_beams=1) == [{"translation_text": "MOON RIVER"}]


def test_translate_command_reads_a_file_or_stdin(tmp_path, trained_folder, capsys) -> None:
    source = tmp_path / "input.txt"
    source.write_text("\n".join(SENTENCES) + "\n")
    main(
        [
            "translate",
            str(trained_folder),
            "--input",
            str(source),
            "--output",
            str(tmp_path / "out.txt"),
            "--batch-size",
            "2",
        ]
    )
    expected = [s.upper() for s in SENTENCES]
    assert (tmp_path / "out.txt").read_text().splitlines() == expected
    result = subprocess.run(
        [sys.executable, "-m", "hf_vaswani.cli", "translate", str(trained_folder)],
        input="sun moon\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "SUN MOON\n"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_translate_and_evaluate_in_a_half_precision(tmp_path, trained_folder, capsys, monkeypatch, dtype: str) -> None:
    """--dtype loads the weights in that type and decodes in it: the trained fixture's margin (LOGIT_MARGIN) is far
    above bf16's and fp16's rounding of its logits, so every probe sentence translates right. On any CPU: where it has
    no instructions for the type, which the commands refuse (tests/test_cli_errors.py), torch emulates them."""
    from hf_vaswani.decoding import loading
    from hf_vaswani.decoding.loading import DTYPES, load_model_folder

    monkeypatch.setattr(loading, "cpu_float_type_problem", lambda dtype: None)

    model, _ = load_model_folder(trained_folder, dtype=dtype)
    assert {parameter.dtype for parameter in model.parameters()} == {DTYPES[dtype]}
    source, reference = tmp_path / "probe.txt", tmp_path / "probe.upper.txt"
    source.write_text("\n".join(PROBE_SENTENCES) + "\n")
    reference.write_text("\n".join(sentence.upper() for sentence in PROBE_SENTENCES) + "\n")
    capsys.readouterr()
    main(["translate", str(trained_folder), "--input", str(source), "--dtype", dtype])
    assert capsys.readouterr().out.splitlines() == [sentence.upper() for sentence in PROBE_SENTENCES]
    main(["evaluate", str(trained_folder), "--source", str(source), "--reference", str(reference), "--dtype", dtype])
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(100.0)


def test_plot_attention_command_writes_three_heatmap_pngs(tmp_path, trained_folder) -> None:
    main(["plot-attention", str(trained_folder), "--sentence", "red cat sun", "--output-dir", str(tmp_path)])
    for name in ("encoder_attention.png", "decoder_attention.png", "encoder_decoder_attention.png"):
        assert (tmp_path / name).stat().st_size > 5_000


def test_beams_sharing_encoder_states_decode_as_transformers_copies(capitaliser, monkeypatch) -> None:
    """One copy of the encoder states per sentence gives what transformers' num_beams copies (and reordering) give."""
    model, tokenizer = capitaliser
    batch = tokenizer(["red cat sun moon", "blue dog", "green tree river sun cat"], return_tensors="pt", padding=True)
    options = dict(
        num_beams=4,
        num_return_sequences=3,
        length_penalty=1.0,  # scores compared below: keep them free of the length term
        return_dict_in_generate=True,
        output_scores=True,
        output_attentions=True,
    )
    shared = model.generate(**batch, **options)
    stock_expansion = GenerationMixin._expand_inputs_for_generation
    monkeypatch.setattr(PaperDecodingMixin, "_expand_inputs_for_generation", stock_expansion)
    monkeypatch.delattr(PaperDecodingMixin, "_reorder_cache")
    copied = model.generate(**batch, **options)
    assert torch.equal(shared.sequences, copied.sequences)
    torch.testing.assert_close(shared.sequences_scores, copied.sequences_scores)
    for step_shared, step_copied in zip(shared.cross_attentions, copied.cross_attentions, strict=True):
        for layer_shared, layer_copied in zip(step_shared, step_copied, strict=True):
            assert layer_shared.shape == layer_copied.shape  # (sentences x beams, heads, 1, source length)
            torch.testing.assert_close(layer_shared, layer_copied)


@pytest.mark.parametrize(
    "eos_token_id", [torch.tensor([EOS]), torch.tensor([EOS, 4]), torch.tensor([4, 99]), torch.tensor([], dtype=int)]
)
def test_banned_columns_processor_scores_as_transformers_ban_and_minimum_length_processors(eos_token_id) -> None:
    """At every length, below, at and above the minimum, with end tokens inside, outside and absent from the vocabulary,
    alone and with a ban of single tokens (one of them an end token, which theirs never bans): one processor in place
    of transformers' adjacent ones, the same scores as theirs applied in turn, and the input scores untouched."""
    torch.manual_seed(0)
    vocab_size = 7
    scores = torch.randn(5, vocab_size)
    original = scores.clone()
    for length, minimum, prompt in itertools.product(range(1, 7), range(0, 6), range(0, 3)):
        input_ids = torch.randint(0, vocab_size, (5, length))
        minimum_length = MinLengthLogitsProcessor(minimum, eos_token_id)
        minimum_new_tokens = MinNewTokensLengthLogitsProcessor(prompt, minimum, eos_token_id)
        ban = NoBadWordsLogitsProcessor([[1], [5], [EOS]], eos_token_id)
        for stock in ([minimum_length], [minimum_new_tokens], [ban], [ban, minimum_length, minimum_new_tokens]):
            ours = BannedColumnsLogitsProcessor.merging(LogitsProcessorList(stock), vocab_size)
            assert len(ours) == 1 and isinstance(ours[0], BannedColumnsLogitsProcessor)
            assert torch.equal(ours(input_ids, scores), LogitsProcessorList(stock)(input_ids, scores))
    assert torch.equal(scores, original)


def test_banned_columns_processor_leaves_what_it_cannot_do_to_transformers() -> None:
    """Multi-token bad words (which depend on the tokens before), processors between and a caller's own instance stay
    as they are; a banned token outside the vocabulary is the same error as theirs."""
    multi_token = NoBadWordsLogitsProcessor([[1, 2], [3]], torch.tensor([EOS]))
    temperature = TemperatureLogitsWarper(0.5)
    minimum = MinLengthLogitsProcessor(3, torch.tensor([EOS]))
    merged = BannedColumnsLogitsProcessor.merging(LogitsProcessorList([multi_token, minimum, temperature, minimum]), 7)
    assert merged[0] is multi_token and merged[2] is temperature
    assert all(isinstance(merged[index], BannedColumnsLogitsProcessor) for index in (1, 3)) and len(merged) == 4
    callers = BannedColumnsLogitsProcessor([(torch.tensor([4]), math.inf, 0)])
    merged = BannedColumnsLogitsProcessor.merging(LogitsProcessorList([callers, minimum]), 7)
    assert merged[0] is callers and len(callers.rules) == 1 and merged[1] is not callers  # the caller's is left alone
    out_of_vocabulary = NoBadWordsLogitsProcessor([[3], [9]], torch.tensor([EOS]))
    with pytest.raises(ValueError, match="vocabulary size is 7") as theirs:
        out_of_vocabulary(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 7))
    with pytest.raises(ValueError, match="vocabulary size is 7") as ours:
        BannedColumnsLogitsProcessor.merging(LogitsProcessorList([out_of_vocabulary]), 7)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_banned_tokens_and_minimum_lengths_decode_as_with_transformers_processors(num_beams: int, monkeypatch) -> None:
    """`bad_words_ids`, `min_new_tokens`, `min_length` give the outputs and scores of transformers' own processors."""
    model = peaked_model(3, vocab_size=9)
    offset_eos_logit(model, 3.0)  # </s> likely at every step: the minimum decides the lengths
    source = torch.tensor([[3, 4, 5, 6], [6, 5, 4, 3]])
    options = dict(num_beams=num_beams, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    minimums = [
        dict(min_new_tokens=5),
        dict(min_length=4),
        dict(min_new_tokens=3, min_length=6),
        dict(bad_words_ids=[[4], [7]]),
        dict(bad_words_ids=[[4], [7]], min_new_tokens=3),
    ]
    ours = [model.generate(input_ids=source, **options, **minimum) for minimum in minimums]
    monkeypatch.setattr(PaperDecodingMixin, "_get_logits_processor", GenerationMixin._get_logits_processor)
    stock = [model.generate(input_ids=source, **options, **minimum) for minimum in minimums]
    for got, expected in zip(ours, stock, strict=True):
        assert torch.equal(got.sequences, expected.sequences)
        for step_got, step_expected in zip(got.scores, expected.scores, strict=True):
            assert torch.equal(step_got, step_expected)
    assert min(output.sequences.shape[1] for output in ours[:3]) > 4  # the minimums held back </s>
    unbanned = model.generate(input_ids=source, **options, min_new_tokens=3).sequences
    assert torch.isin(unbanned, torch.tensor([4, 7])).any()  # so the ban has tokens to keep out
    assert not torch.isin(ours[-1].sequences, torch.tensor([4, 7])).any()
