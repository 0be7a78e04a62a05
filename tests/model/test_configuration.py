"""Config validation, the paper's presets and their parameter counts (Table 3), and Auto-class registration."""

import json
import re

import pytest
import torch
from tiny import SMALLEST_MODEL
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

import hf_vaswani  # noqa: F401  (registers the Auto classes)
from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel
from hf_vaswani.model.configuration_vaswani import RETIRED_KEYS


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(d_model=-8), "d_model"),
        (dict(d_ff=0), "d_ff"),
        (dict(num_heads=0), "num_heads"),
        (dict(d_k=0), "d_k"),
        (dict(d_v=-1), "d_v"),
        (dict(encoder_layers=0), "encoder_layers"),
        (dict(decoder_layers=-2), "decoder_layers"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(d_model=500, num_heads=8), "d_model"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(attention_dropout=1.5), "attention_dropout"),
        (dict(activation_dropout=-0.5), "activation_dropout"),
        (dict(label_smoothing=1.0), "label_smoothing"),
        (dict(positional_encoding="rotary"), "positional_encoding"),
        (dict(initialization="xavier"), "initialization"),
        (dict(pad_token_id=37000), "pad_token_id"),
        (dict(bos_token_id=-1), "bos_token_id"),
        (dict(eos_token_id=50000), "eos_token_id"),
        (dict(decoder_start_token_id=99999), "decoder_start_token_id"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
        (dict(source_vocab_size=0, share_embeddings=False), "source_vocab_size"),
        (dict(source_vocab_size=500, share_embeddings=True), "source_vocab_size"),
        (dict(d_model=511, num_heads=1), "d_model"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        VaswaniConfig(**overrides)


NON_FINITE = [
    (field, value)
    for field in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing", "layer_norm_eps")
    for value in (float("nan"), float("inf"))
]


@pytest.mark.parametrize(("field", "value"), NON_FINITE)
def test_non_finite_numbers_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number, got {value}$"):
        VaswaniConfig(**{field: value})


@pytest.mark.parametrize(("key", "message"), [("d_modle", "; did you mean 'd_model'?"), ("colour", "")])
def test_unknown_keys_are_refused_naming_the_key(key: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^VaswaniConfig has no key '{key}'{re.escape(message)}$"):
        VaswaniConfig(**{key: 32})


def test_keys_that_transformers_passes_or_saves_are_accepted(tmp_path) -> None:
    transformers_keys = dict(
        torch_dtype="float32",
        dtype="float32",
        architectures=["VaswaniForConditionalGeneration"],
        auto_map={"AutoConfig": "configuration_vaswani.VaswaniConfig"},
        transformers_version="5.23.0",
        custom_pipelines={},
        _name_or_path="somewhere",
        return_dict=False,
        output_attentions=True,
        attn_implementation="eager",
        num_beams=4,  # a generation setting saved in config.json by old versions: transformers drops it
        hidden_size=32,  # attribute_map's name of d_model
    )
    config = VaswaniConfig(**transformers_keys, num_heads=2, vocab_size=40)
    assert config.d_model == 32 and config.return_dict is False and config.output_attentions
    model = VaswaniForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, output_attentions=False).d_model == 32
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype="float32", attn_implementation="eager")
    assert loaded.config.to_diff_dict() == AutoConfig.from_pretrained(tmp_path).to_diff_dict()


def test_what_save_pretrained_writes_from_pretrained_reads(tmp_path, caplog) -> None:
    """An attribute another tool sets on a config (PEFT, TRL, transformers' test helpers) survives a save and a load,
    with a warning naming it; the constructor still refuses the same key when given by hand (test above)."""
    model = VaswaniForConditionalGeneration(VaswaniConfig(**SMALLEST_MODEL))
    model.config.some_tool_field = {"rank": 8}
    model.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        config = AutoConfig.from_pretrained(tmp_path)
    assert config.some_tool_field == {"rank": 8} and config.d_model == SMALLEST_MODEL["d_model"]
    assert "some_tool_field" in caplog.text
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert loaded.config.some_tool_field == {"rank": 8}
    for name, parameter in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], parameter, rtol=0, atol=0)


def test_retired_keys_of_saved_configs_are_dropped(tmp_path) -> None:
    VaswaniConfig(num_heads=2, d_model=16, vocab_size=40).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not RETIRED_KEYS & saved.keys()
    (tmp_path / "config.json").write_text(json.dumps(saved | dict.fromkeys(RETIRED_KEYS, True)))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.d_model == 16 and not any(hasattr(loaded, key) for key in RETIRED_KEYS)


def test_d_k_and_d_v_are_free_when_given() -> None:
    config = VaswaniConfig(d_model=500, num_heads=8, d_k=16, d_v=64)  # 500 is not divisible by 8: fine with d_k, d_v
    assert (config.d_k, config.d_v) == (16, 64)
    base = VaswaniConfig.base()
    assert (base.d_k, base.d_v) == (64, 64)


def test_presets_are_table_3_base_and_big() -> None:
    base, big = VaswaniConfig.base(), VaswaniConfig.big()
    assert (base.encoder_layers, base.decoder_layers, base.d_model, base.d_ff, base.num_heads) == (6, 6, 512, 2048, 8)
    assert (base.dropout, base.layer_norm_eps) == (0.1, 1e-6)
    # architecture only: their loss is the cross-entropy; §5.4's smoothing is the training recipe's (RecipeSettings)
    assert base.label_smoothing == big.label_smoothing == 0.0
    assert (base.attention_dropout, base.activation_dropout, base.positional_encoding) == (0.0, 0.0, "sinusoidal")
    assert (big.d_model, big.d_ff, big.num_heads, big.d_k, big.d_v, big.dropout) == (1024, 4096, 16, 64, 64, 0.3)
    assert VaswaniConfig.big(dropout=0.1).dropout == 0.1  # En-Fr big


def parameter_count(config: VaswaniConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in VaswaniForConditionalGeneration(config).parameters())


# Table 3 of the paper: parameter counts (x 10^6) with the ~37k shared En-De vocabulary.
TABLE_3 = [
    (dict(), 65),
    (dict(num_heads=1, d_k=512, d_v=512), 65),
    (dict(num_heads=16, d_k=32, d_v=32), 65),
    (dict(d_k=16), 58),
    (dict(d_k=32), 60),
    (dict(encoder_layers=2, decoder_layers=2), 36),
    (dict(encoder_layers=4, decoder_layers=4), 50),
    (dict(encoder_layers=8, decoder_layers=8), 80),
    (dict(d_model=256, d_k=32, d_v=32), 28),
    (dict(d_model=1024, d_k=128, d_v=128), 168),
    (dict(d_ff=1024), 53),
    (dict(d_ff=4096), 90),
]


def test_parameter_counts_reproduce_table_3() -> None:
    base = parameter_count(VaswaniConfig.base(vocab_size=37000))
    big = parameter_count(VaswaniConfig.big(vocab_size=37000))
    assert base == 63_082_496  # paper: 65M with "about 37000" tokens; 3.7k more tokens would add the missing 1.9M
    assert abs(base / 1e6 - 65) < 2.5
    assert abs(big / 1e6 - 213) < 1.5
    # The differences between rows do not depend on the exact vocabulary: they must match the paper's.
    for overrides, paper in TABLE_3:
        count = parameter_count(VaswaniConfig.base(vocab_size=37000, **overrides))
        assert abs((count - base) / 1e6 - (paper - 65)) < 2.5, overrides


def test_auto_classes_resolve_to_vaswani(tmp_path) -> None:
    config = VaswaniConfig(**SMALLEST_MODEL)
    assert type(AutoConfig.for_model("vaswani")) is VaswaniConfig
    assert type(AutoModel.from_config(config)) is VaswaniModel
    model = AutoModelForSeq2SeqLM.from_config(config)
    assert type(model) is VaswaniForConditionalGeneration
    model.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is VaswaniConfig
    assert type(AutoModelForSeq2SeqLM.from_pretrained(tmp_path)) is VaswaniForConditionalGeneration
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is VaswaniModel
    torch.testing.assert_close(base.encoder.embeddings.embed_tokens.weight, model.get_input_embeddings().weight)
