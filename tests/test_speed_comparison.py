"""scripts/speed_comparison.py, what scripts/benchmark.py and scripts/gpu_figures.py share: the pair computes one
function, the token batches and the forced output length are as asked, a training step trains either model, and
time_calls times the calls it is asked to."""

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hf_vaswani import VaswaniConfig

SCRIPTS = Path(__file__).parents[1] / "scripts"
CONFIG = VaswaniConfig(vocab_size=40, d_model=16, d_ff=32, num_heads=2, encoder_layers=1, decoder_layers=1)


@pytest.fixture(scope="module")
def comparison() -> Iterator[ModuleType]:
    sys.path.insert(0, str(SCRIPTS))  # as the scripts, run from scripts/, import it
    try:
        import speed_comparison

        yield speed_comparison
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture(scope="module")
def batch(comparison) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: comparison.random_tokens(generator, 3, 5, CONFIG.vocab_size) for name in ("input_ids", "labels")}


def test_the_pair_computes_one_function(comparison, batch) -> None:
    ours, marian = comparison.model_pair(CONFIG)
    assert not ours.training and not marian.training
    assert ours.config._attn_implementation == marian.config._attn_implementation == "sdpa"
    inputs = {"input_ids": batch["input_ids"], "decoder_input_ids": batch["labels"]}
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs).logits, marian(**inputs).logits, atol=1e-5, rtol=1e-5)
    again, _ = comparison.model_pair(CONFIG)  # seeded
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), again.parameters(), strict=True))


def test_random_tokens_are_words_ending_in_eos(comparison, batch) -> None:
    tokens = batch["input_ids"]
    assert tokens.shape == (3, 5)
    assert (tokens[:, -1] == comparison.EOS).all()
    assert ((tokens[:, :-1] >= comparison.FIRST_WORD) & (tokens[:, :-1] < CONFIG.vocab_size)).all()
    tokenizer = comparison.word_tokenizer(CONFIG.vocab_size)
    assert len(tokenizer) == CONFIG.vocab_size
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokens[0].tolist())) == tokens[0].tolist()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (comparison.PAD, comparison.EOS)


def test_a_training_step_trains_either_model(comparison, batch) -> None:
    for model in comparison.model_pair(CONFIG):
        before = [weight.detach().clone() for weight in model.parameters()]
        step = comparison.TrainingStep(model, batch, smoothing=0.1)
        step()
        assert model.training and step.tokens == 30
        assert all(weight.grad is None for weight in model.parameters())  # dropped after the update
        assert any(not torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))


def test_decoding_is_forced_to_the_length_asked(comparison, batch) -> None:
    _, marian = comparison.model_pair(CONFIG)
    output = comparison.transformers_loop(marian, input_ids=batch["input_ids"], **comparison.forced_length(4))
    assert comparison.produced_tokens(output, 4, "MarianMT") == 4
    with pytest.raises(RuntimeError, match="MarianMT generated 4 tokens instead of 5"):
        comparison.produced_tokens(output, 5, "MarianMT")


def test_time_calls_times_the_repeats_after_the_warmup(comparison) -> None:
    calls = []
    seconds = comparison.time_calls(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and seconds >= 0
