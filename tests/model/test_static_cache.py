"""A static cache and a compiled decoding step give eager decoding's outputs; the caches `generate` hands back have the
shapes stock tools expect."""

import pytest
import torch
from tiny import SMALLEST_MODEL, random_model
from transformers.cache_utils import EncoderDecoderCache, StaticCache

from hf_vaswani import VaswaniForConditionalGeneration


@pytest.fixture(scope="module")
def model_and_batch():
    model = random_model(0, encoder_layers=2, decoder_layers=2)
    source = torch.randint(3, SMALLEST_MODEL["vocab_size"], (3, 6))
    mask = torch.ones_like(source)
    mask[1, 4:] = 0
    source[1, 4:] = model.config.pad_token_id
    # equal lengths for every decoding, so that outputs compare element by element
    options = dict(input_ids=source, attention_mask=mask, max_new_tokens=8, min_new_tokens=8)
    return model, options


@pytest.mark.parametrize("num_beams", [1, 3])
def test_static_cache_decodes_as_the_dynamic_one(model_and_batch, num_beams: int) -> None:
    model, options = model_and_batch
    dynamic = model.generate(**options, num_beams=num_beams, return_dict_in_generate=True, output_scores=True)
    static = model.generate(
        **options, num_beams=num_beams, cache_implementation="static", return_dict_in_generate=True, output_scores=True
    )
    assert isinstance(static.cache.self_attention_cache, StaticCache)
    assert torch.equal(dynamic.sequences, static.sequences)
    for dynamic_step, static_step in zip(dynamic.scores, static.scores, strict=True):
        torch.testing.assert_close(dynamic_step, static_step)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_fullgraph_compiled_decoding_step_gives_eager_outputs(model_and_batch, num_beams: int) -> None:
    """`fullgraph=True` fails on any graph break, so this also shows the step compiles to one graph."""
    model, options = model_and_batch
    eager = model.generate(**options, num_beams=num_beams, cache_implementation="static")
    torch._dynamo.reset()
    original = model.forward
    try:
        model.forward = torch.compile(original, fullgraph=True, backend="aot_eager")
        compiled = model.generate(**options, num_beams=num_beams, cache_implementation="static")
    finally:
        model.forward = original
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_returned_cache_has_a_cross_attention_row_per_beam(model_and_batch, cache_implementation: str | None) -> None:
    """While decoding, the beams of a sentence share its encoder keys and values (attend_with_shared_source); the cache
    returned to the caller holds one row per beam, as transformers' own models return it."""
    model, options = model_and_batch
    out = model.generate(
        **options,
        num_beams=3,
        num_return_sequences=1,
        return_dict_in_generate=True,
        cache_implementation=cache_implementation,
    )
    cache = out.cache
    assert isinstance(cache, EncoderDecoderCache)
    for self_layer, cross_layer in zip(
        cache.self_attention_cache.layers, cache.cross_attention_cache.layers, strict=True
    ):
        assert self_layer.keys.shape[0] == cross_layer.keys.shape[0] == 3 * 3
        assert cross_layer.keys.shape[2] == options["input_ids"].shape[1]
    # each beam's row is its sentence's: the copies transformers would have made
    torch.testing.assert_close(cross_layer.keys[0:3], cross_layer.keys[0:1].expand(3, -1, -1, -1))


def test_a_new_model_decodes_with_transformers_defaults_and_a_trained_one_as_the_paper(tmp_path) -> None:
    """§6.1's beam 4 is what the recipe and converters save; an untrained model starts from transformers' defaults."""
    from hf_vaswani.model.generation_vaswani import paper_generation_config

    model = random_model()
    assert model.generation_config.num_beams in (None, 1)  # None: transformers resolves it to 1 (greedy)
    model.generation_config = paper_generation_config(model.config)
    model.save_pretrained(tmp_path)
    assert VaswaniForConditionalGeneration.from_pretrained(tmp_path).generation_config.num_beams == 4
