"""The package's decoding loop (hf_vaswani/decoding/search.py) against transformers' own: same sequences, same scores;
and which of the two a call runs."""

import pytest
import torch
from helpers import (
    EOS,
    best,
    count_host_reads,
    exhaustive_scores,
    offset_eos_logit,
    padded_batch,
    peaked_model,
    sharpened,
    strip,
    take_tensors_as_on_an_accelerator,
)
from tiny import PROBE_SENTENCES, TINY_MODEL, UNEVEN_MODEL, random_model, tiny_marian
from transformers import (
    AutoModelForSeq2SeqLM,
    GenerationConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
)
from transformers.cache_utils import StaticCache

from hf_vaswani import kernelize
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.decoding.search import (
    INACTIVE_VALUES,
    READ_SETTINGS,
    UNREAD_SETTINGS,
    Decoder,
    Request,
    SearchState,
    covered_request,
    decode,
    generate,
)
from hf_vaswani.interop.convert import from_marian
from hf_vaswani.kernels.cpu import packed_weights
from hf_vaswani.model.generation_vaswani import PaperDecodingMixin, paper_generation_config

# Each covered option, alone or with the others it is used with; every one is run by both loops on each model below.
COVERED_CALLS = {
    "greedy": dict(num_beams=1),
    "greedy, scores": dict(num_beams=1, output_scores=True, return_dict_in_generate=True),
    "greedy, ban and minimum": dict(num_beams=1, bad_words_ids=[[5], [7]], min_new_tokens=3),
    "beam 4, paper's": dict(num_beams=4),
    "beam 5, early_stopping False": dict(num_beams=5, early_stopping=False),
    "beam 3, never, power": dict(num_beams=3, early_stopping="never", length_penalty_type="power"),
    "beam 2, negative alpha": dict(num_beams=2, length_penalty=-0.5),
    "beam 4, n-best with scores": dict(
        num_beams=4, num_return_sequences=3, output_scores=True, return_dict_in_generate=True
    ),
    "beam 4, ban, min_length": dict(num_beams=4, bad_words_ids=[[6]], min_length=4),
    "beam 3, cap 2 over the source": dict(num_beams=3, max_new_tokens_over_source=2),
    "beam 4, absolute cap": dict(num_beams=4, max_new_tokens=3, max_new_tokens_over_source=None),
    "beam 2, transformers' default length": dict(num_beams=2, max_new_tokens_over_source=None),
    "greedy, max_length": dict(num_beams=1, max_length=5, max_new_tokens_over_source=None),
}
MODELS = [  # (seed, sizes and changes): tied and untied outputs, d_k != d_v, more decoder than encoder layers
    (0, TINY_MODEL, {}),
    (1, UNEVEN_MODEL, {}),
    (2, TINY_MODEL, dict(share_embeddings=False, tie_word_embeddings=False)),
    (3, UNEVEN_MODEL, dict(vocab_size=23)),
    (4, TINY_MODEL, dict(positional_encoding="learned")),
    (5, UNEVEN_MODEL, dict(share_embeddings=False, tie_word_embeddings=False, vocab_size=31)),
]


def assert_same_output(ours, theirs) -> None:
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), f"\n{ours}\n{theirs}"
        return
    assert type(ours) is type(theirs)
    assert torch.equal(ours.sequences, theirs.sequences), f"\n{ours.sequences}\n{theirs.sequences}"
    for name in ("sequences_scores", "beam_indices"):
        if hasattr(theirs, name):
            ours_value, theirs_value = getattr(ours, name), getattr(theirs, name)
            assert (ours_value is None) == (theirs_value is None), name
            if theirs_value is not None:
                torch.testing.assert_close(ours_value, theirs_value, rtol=1e-6, atol=0.0, check_dtype=False)
    assert (ours.scores is None) == (theirs.scores is None)
    if theirs.scores is not None:
        assert len(ours.scores) == len(theirs.scores)
        for ours_step, theirs_step in zip(ours.scores, theirs.scores, strict=True):
            torch.testing.assert_close(ours_step, theirs_step, rtol=1e-6, atol=1e-6)


def by_transformers_loop(model, inputs=None, **kwargs):
    """`model.generate`, its products multiplied as the package's search multiplies them (packed weights, where the
    CPU has a faster kernel for them): the loops are compared, not the kernels."""
    with packed_weights(model):
        return model.generate(inputs, **kwargs)


def by_package_loop(model, inputs=None, **kwargs):
    """The package's search on a call that its loop must cover: a call passed on to transformers' loop fails here."""
    request = covered_request(model, inputs, None, kwargs)
    assert isinstance(request, Request), request
    return generate(model, inputs, **kwargs)


@pytest.mark.parametrize(("seed", "sizes", "changes"), MODELS, ids=[str(seed) for seed, _, _ in MODELS])
def test_covered_calls_decode_as_transformers_loop(seed: int, sizes: dict, changes: dict) -> None:
    model = sharpened(kernelize(random_model(seed, sizes, **changes)))
    model.generation_config = paper_generation_config(model.config)
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=seed, eos_token_id=EOS)
    ends_seen = set()
    for name, call in COVERED_CALLS.items():
        ours = by_package_loop(model, source, attention_mask=mask, **call)
        theirs = by_transformers_loop(model, source, attention_mask=mask, **call)
        assert_same_output(ours, theirs), name
        sequences = ours if isinstance(ours, torch.Tensor) else ours.sequences
        ends_seen.update(int(row.eq(EOS).nonzero()[0]) if row.eq(EOS).any() else -1 for row in sequences)
    assert len(ends_seen) >= 3, "hypotheses all ended alike: the comparison would miss length-dependent rules"


def test_without_a_mask_the_whole_source_is_attended_as_by_transformers() -> None:
    model = sharpened(kernelize(random_model(7, TINY_MODEL)))
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=7, eos_token_id=EOS)
    masked = model.generate(source, attention_mask=mask, max_new_tokens=6)
    unmasked = model.generate(source, max_new_tokens=6)
    assert not torch.equal(masked, unmasked), "the padding changes nothing here: the test would prove nothing"
    for num_beams in (1, 4):
        ours = by_package_loop(model, source, num_beams=num_beams, max_new_tokens=6)
        theirs = by_transformers_loop(model, source, num_beams=num_beams, max_new_tokens=6)
        assert torch.equal(ours, theirs)


def test_wide_beams_return_the_exhaustive_search_best() -> None:
    """With as many beams as prefixes, beam search is exhaustive: the loop returns the formula's argmax."""
    max_new, checked = 3, 0
    for seed, eos_boost, alpha in [(4, 4.0, 1.0), (0, 0.0, 0.6), (1, 2.0, 0.6), (2, 3.0, 0.6)]:
        model = peaked_model(seed)
        offset_eos_logit(model, eos_boost)
        model = kernelize(model)
        source = torch.tensor([[3, 4, 5, EOS]])
        scores = exhaustive_scores([model], source, max_new, alpha)
        for form in ("gnmt", "power"):
            expected, margin = best(scores, form)
            if margin < 1e-4:
                continue  # a near tie: float rounding could pick either
            output = by_package_loop(
                model,
                source,
                num_beams=5**max_new,
                max_new_tokens=max_new,
                early_stopping="never",
                length_penalty=alpha,
                length_penalty_type=form,
                max_new_tokens_over_source=None,
                output_scores=True,
                return_dict_in_generate=True,
            )
            assert strip(output.sequences[0]) == expected, (seed, form)
            assert float(output.sequences_scores[0]) == pytest.approx(scores[expected][form], abs=1e-4)
            checked += 1
    assert checked >= 6


def test_the_trained_models_translations_are_the_same(trained_folder) -> None:
    model, tokenizer = load_model_folder(trained_folder)  # kernelized, as the package loads models
    batch = tokenizer(PROBE_SENTENCES, return_tensors="pt", padding=True)
    for num_beams in (1, 4):
        ours = by_package_loop(model, **batch, num_beams=num_beams)
        theirs = by_transformers_loop(model, **batch, num_beams=num_beams)
        assert torch.equal(ours, theirs)
        assert tokenizer.batch_decode(ours, skip_special_tokens=True) == [s.upper() for s in PROBE_SENTENCES]


def test_calls_it_does_not_cover_go_to_transformers_loop(monkeypatch) -> None:
    model = kernelize(random_model(0, TINY_MODEL))
    source = torch.tensor([[5, 6, 7, EOS]])
    uncovered = {
        "do_sample=True": dict(do_sample=True, num_beams=2),
        "repetition_penalty=1.3": dict(repetition_penalty=1.3),
        "logits processors of the caller": dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])),
        "output_attentions=True": dict(output_attentions=True, return_dict_in_generate=True),
        "bad_words_ids of several tokens": dict(bad_words_ids=[[5, 6]]),
    }
    for reason, call in uncovered.items():
        assert reason.split("=")[0] in covered_request(model, source, None, dict(max_new_tokens=4, **call))
        torch.manual_seed(0)
        ours = generate(model, source, max_new_tokens=4, **call)
        torch.manual_seed(0)
        theirs = by_transformers_loop(model, source, max_new_tokens=4, **call)
        assert torch.equal(getattr(ours, "sequences", ours), getattr(theirs, "sequences", theirs)), reason
    # more than inputs and generation_config by position: the same refusal as the model's own generate
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    for search in (generate, model.generate):
        with pytest.raises(TypeError, match="generate\\(\\) takes from 1 to 3 positional arguments but 4"):
            search(model, source, None, processors) if search is generate else search(source, None, processors)


def models_built_loaded_and_converted(folder) -> dict:
    """The package's model as each way of making one gives it: built, loaded by the package and by the Auto classes
    (also from a folder with remote code), and converted from a MarianMTModel."""
    built = random_model(0, TINY_MODEL)
    built.save_pretrained(folder)
    return {
        "built": built,
        "kernelized": kernelize(random_model(0, TINY_MODEL)),
        "Auto class": AutoModelForSeq2SeqLM.from_pretrained(folder),
        "Auto class, remote code": AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True),
        "converted": from_marian(tiny_marian(scale_embedding=True, forced_eos_token_id=None)),  # a call both loops run
    }


def test_each_search_is_the_same_however_the_model_was_made(tmp_path, trained_folder, monkeypatch) -> None:
    """`model.generate` is transformers' loop and `hf_vaswani.generate` the package's, for every model: nothing that
    builds, loads, converts or kernelizes a model replaces its `generate`."""
    from hf_vaswani.decoding import search

    models = models_built_loaded_and_converted(tmp_path / "model")
    models["loaded by the package"] = load_model_folder(trained_folder)[0]
    package_calls = []
    real_decode = search.decode
    monkeypatch.setattr(search, "decode", lambda *args: package_calls.append(1) or real_decode(*args))
    for name, model in models.items():
        assert "generate" not in vars(model), name
        assert type(model).generate is PaperDecodingMixin.generate, name
        source = torch.tensor([[5, 6, 7, 2]])
        theirs = by_transformers_loop(model, source, max_new_tokens=3, num_beams=2)
        assert package_calls == [], name
        ours = generate(model, source, max_new_tokens=3, num_beams=2)
        assert package_calls == [1], name
        assert torch.equal(ours, theirs), name
        package_calls.clear()


def test_every_generation_setting_is_read_unread_or_covered_only_where_inactive() -> None:
    """A setting a transformers release adds must be placed in one group before the loop may cover calls using it."""
    groups = [READ_SETTINGS, UNREAD_SETTINGS, set(INACTIVE_VALUES)]
    settings = set(GenerationConfig().to_dict())
    unplaced = settings - set().union(*groups)
    assert not unplaced, f"GenerationConfig settings new to hf_vaswani.decoding.search: {sorted(unplaced)}"
    assert sum(len(group) for group in groups) == len(set().union(*groups)), "a setting is in two groups"


ACCELERATOR_CALLS = {
    "greedy, ban and minimum": dict(num_beams=1, bad_words_ids=[[5], [7]], min_new_tokens=3),
    "beam 4, cap 2 over the source": dict(num_beams=4, max_new_tokens_over_source=2),
    "beam 3, n-best with scores, min_length": dict(
        num_beams=3, num_return_sequences=2, output_scores=True, return_dict_in_generate=True, min_length=4
    ),
    "beam 5, early_stopping False": dict(num_beams=5, early_stopping=False),
}


@pytest.mark.parametrize("call", ACCELERATOR_CALLS.values(), ids=ACCELERATOR_CALLS.keys())
@pytest.mark.parametrize("positional_encoding", ["sinusoidal", "learned"])
def test_on_an_accelerator_a_step_reads_one_value_on_the_host(monkeypatch, call: dict, positional_encoding) -> None:
    """Whether to go on. The cache is then a static one written in place and the source-length cap masks every row;
    the sequences and scores are still transformers'. Counted in a second call: the first compiles the step, which
    reads scalar tensors' values while tracing, once."""
    model = sharpened(kernelize(random_model(0, TINY_MODEL, positional_encoding=positional_encoding)))
    model.generation_config = paper_generation_config(model.config)
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=3, eos_token_id=EOS)
    theirs = by_transformers_loop(model, source, attention_mask=mask, **call)
    caches = []
    next_logits = Decoder.next_logits

    def counted_step(decoder: Decoder, tokens: torch.Tensor) -> torch.Tensor:
        caches.append(type(decoder.cache.self_attention_cache))
        return next_logits(decoder, tokens)

    monkeypatch.setattr(Decoder, "next_logits", counted_step)
    take_tensors_as_on_an_accelerator(monkeypatch)
    request = covered_request(model, source, None, {"attention_mask": mask, **call})  # reads the source lengths
    state = SearchState("compiled", compile=True)
    decode([model], request, [state])
    caches.clear()
    host_reads = count_host_reads(monkeypatch)
    ours = decode([model], request, [state])
    assert len(caches) > 3 and sum(host_reads.values()) <= len(caches), (dict(host_reads), len(caches))
    assert set(caches) == {StaticCache}
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs)
        return
    # The same tokens; each attention row's softmax also sums the masked tail of the preallocated cache, which moves a
    # score by a few float32 ulps of its size.
    assert torch.equal(ours.sequences, theirs.sequences) and torch.equal(ours.beam_indices, theirs.beam_indices)
    torch.testing.assert_close(ours.sequences_scores, theirs.sequences_scores, rtol=1e-5, atol=1e-5)
    for ours_step, theirs_step in zip(ours.scores, theirs.scores, strict=True):
        torch.testing.assert_close(ours_step, theirs_step, rtol=1e-5, atol=1e-5)
