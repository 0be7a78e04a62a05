"""The speed-ups compute what the plain modules compute: packed projections, dropout masks, int8 inference."""

import json
import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.fast_paths_vaswani import VaswaniDropout, VaswaniLinear, packed_decoder_weights
from hf_vaswani.inference import quantize_int8

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL-packed weights need MKL")


@needs_mkl
@pytest.mark.parametrize("rows", [1, 5, 32, 256, 300])
def test_packed_projection_equals_torch_linear(rows: int) -> None:
    torch.manual_seed(0)
    layer = VaswaniLinear(48, 80)
    inputs = torch.randn(rows, 1, 48)
    with packed_decoder_weights([layer]), torch.no_grad():
        assert layer.packed_weight is not None
        packed = layer(inputs)
    assert layer.packed_weight is None  # the copy lives for the block only
    expected = nn.functional.linear(inputs, layer.weight, layer.bias)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)


@needs_mkl
def test_generate_after_an_in_place_weight_update_uses_the_new_weights(tiny_config_kwargs: dict) -> None:
    """Fused AdamW updates weights without bumping their version: a packed copy kept across calls would go stale."""
    torch.manual_seed(0)
    config = VaswaniConfig(**tiny_config_kwargs)
    model = VaswaniForConditionalGeneration(config).eval()
    source = torch.randint(4, config.vocab_size, (2, 6))
    options = dict(num_beams=2, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    model.generate(input_ids=source, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    model.train()
    model(input_ids=source, labels=source).loss.backward()
    optimizer.step()
    model.eval()
    after = model.generate(input_ids=source, **options)
    fresh = VaswaniForConditionalGeneration(config).eval()
    fresh.load_state_dict(model.state_dict())
    expected = fresh.generate(input_ids=source, **options)
    assert torch.equal(after.sequences, expected.sequences)
    torch.testing.assert_close(after.sequences_scores, expected.sequences_scores)


def test_dropout_drops_at_rate_p_and_keeps_the_expectation() -> None:
    torch.manual_seed(0)
    dropout = VaswaniDropout(0.1).train()
    inputs = torch.rand(2000, 500) + 0.5
    outputs = dropout(inputs)
    dropped = outputs == 0
    n = inputs.numel()
    # binomial(n, 0.1): the fraction is 0.1 within 5 standard deviations
    assert abs(dropped.double().mean().item() - 0.1) < 5 * math.sqrt(0.1 * 0.9 / n)
    rate = round(0.1 * 2**16) / 2**16
    torch.testing.assert_close(outputs[~dropped], inputs[~dropped] / (1 - rate))
    assert abs(outputs.double().mean().item() / inputs.double().mean().item() - 1) < 5e-3  # E[dropout(x)] = x
    # fresh masks every call, and each row of the mask is independent of the others
    assert not torch.equal(dropout(inputs) == 0, dropped)
    assert torch.equal(dropout.eval()(inputs), inputs)


def test_dropout_gradient_is_the_mask_times_the_scale() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(64, 32, requires_grad=True)
    upstream = torch.randn(64, 32)
    outputs = VaswaniDropout(0.3).train()(inputs)
    (outputs * upstream).sum().backward()
    kept = outputs != 0
    scale = 1 / (1 - round(0.3 * 2**16) / 2**16)
    torch.testing.assert_close(inputs.grad, upstream * kept * scale)


def test_int8_model_quantizes_every_projection_and_stays_close(trained_folder) -> None:
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_folder)
    quantized = quantize_int8(model)
    linears = [m for m in quantized.modules() if isinstance(m, nn.Linear)]
    assert not linears  # every projection, the output layer included, became int8
    assert any(isinstance(m, VaswaniLinear) for m in model.modules())  # the float model is left as it was
    batch = tokenizer(["red cat sun", "blue dog moon tree"], return_tensors="pt", padding=True)
    decoder_input_ids = torch.tensor([[1, 20, 30, 40], [1, 50, 60, 70]])
    with torch.no_grad():
        reference = model(**batch, decoder_input_ids=decoder_input_ids).logits.log_softmax(-1)
        int8 = quantized(**batch, decoder_input_ids=decoder_input_ids).logits.log_softmax(-1)
    assert (int8.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    assert (int8.exp() - reference.exp()).abs().max() < 0.1  # probabilities within 10 points
    outputs = quantized.generate(**batch)
    assert tokenizer.batch_decode(outputs, skip_special_tokens=True) == ["RED CAT SUN", "BLUE DOG MOON TREE"]


def test_int8_refuses_a_model_that_is_not_on_cpu(tiny_config_kwargs: dict) -> None:
    model = VaswaniForConditionalGeneration(VaswaniConfig(**tiny_config_kwargs)).to("meta")
    with pytest.raises(ValueError, match="int8 inference runs on CPU"):
        quantize_int8(model)


def test_evaluate_command_with_int8(tmp_path, trained_folder, capsys) -> None:
    (tmp_path / "test.src").write_text("red cat sun\nblue dog moon tree\n")
    (tmp_path / "test.ref").write_text("RED CAT SUN\nBLUE DOG MOON TREE\n")
    arguments = ["evaluate", str(trained_folder), "--source", str(tmp_path / "test.src")]
    main([*arguments, "--reference", str(tmp_path / "test.ref"), "--int8"])
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(100.0)
