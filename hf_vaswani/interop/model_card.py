"""The model card (README.md) of a trained model folder, filled from the package's model_card.md template."""

from importlib import resources
from pathlib import Path
from string import Template
from typing import Protocol

from transformers import GenerationConfig

from ..files import write_text
from ..model.configuration_vaswani import VaswaniConfig


class CardSettings(Protocol):
    """The training settings the card compares with the paper's (a `vaswani train` run's RecipeSettings has them)."""

    label_smoothing: float
    bpe_dropout: float | None
    max_tokens: int
    update_freq: int
    adam_epsilon: float
    max_grad_norm: float | None
    warmup_steps: int
    average_last: int


def exponent(value: float) -> str:
    """`value` as the paper writes such numbers: 1e-9, not Python's 1e-09."""
    mantissa, _, power = f"{value:g}".partition("e")
    return f"{mantissa}e{int(power)}" if power else mantissa


def write_model_card(
    model_dir: Path,
    config: VaswaniConfig,
    settings: CardSettings,
    results: dict,
    source_lang: str,
    target_lang: str,
    dataset_name: str,
    example_source: str,
    model_name: str | None = None,
) -> Path:
    """Fill the package's model_card.md template into `model_dir/README.md` (the Hub's model card).

    The decoding it describes is the one saved in `model_dir/generation_config.json`. `model_name` defaults to the
    folder's name (give it when writing into a temporary folder).
    """
    decoding = GenerationConfig.from_pretrained(model_dir)
    rows = [
        ("layers N (encoder / decoder)", "6 / 6", f"{config.encoder_layers} / {config.decoder_layers}"),
        ("d_model / d_ff / heads h", "512 / 2048 / 8", f"{config.d_model} / {config.d_ff} / {config.num_heads}"),
        ("d_k / d_v", "64 / 64", f"{config.d_k} / {config.d_v}"),
        ("dropout P_drop / label smoothing", "0.1 / 0.1", f"{config.dropout} / {settings.label_smoothing}"),
        ("shared BPE vocabulary", "~37000", str(config.vocab_size)),
        ("BPE-dropout in training", "none", str(settings.bpe_dropout or "none")),
        ("batch (tokens per side)", "~25000", f"{settings.max_tokens} x update_freq {settings.update_freq}"),
        ("optimizer", "Adam(0.9, 0.98, 1e-9)", f"Adam(0.9, 0.98, {exponent(settings.adam_epsilon)})"),
        ("gradient clipping (norm)", "none", str(settings.max_grad_norm or "none")),
        ("warmup steps / training steps", "4000 / 100000", f"{settings.warmup_steps} / {results['steps']}"),
        ("checkpoints averaged", "last 5", f"last {settings.average_last}"),
        ("beam size / length penalty alpha", "4 / 0.6", f"{decoding.num_beams} / {decoding.length_penalty}"),
    ]
    deviations = [name for name, paper, ours in rows if paper != ours]
    template = Template(resources.files("hf_vaswani").joinpath("interop/model_card.md").read_text())
    card = template.substitute(
        source_lang=source_lang,
        target_lang=target_lang,
        dataset=dataset_name,
        dataset_title=dataset_name,
        model_name=model_name or model_dir.name,
        bleu=results["bleu"],
        chrf=results["chrf"],
        tokenized_bleu=results["tokenized_bleu"],
        bleu_signature=results["bleu_signature"],
        example_source=example_source.replace('"', '\\"'),
        measured_on=(
            f"Measured with `{results['command']}` on "
            f"{results['gpu'] + ' beside ' if results.get('gpu') else ''}{results['cpu']} (a seeded run's scores "
            "differ slightly between processor models)."
            if "cpu" in results
            else ""
        ),
        settings_table="\n".join(f"| {name} | {paper} | {ours} |" for name, paper, ours in rows),
        deviations=", ".join(deviations) + "." if deviations else "none.",
        decoding=(
            f"beam {decoding.num_beams}, GNMT length penalty ((5 + |Y|) / 6)^alpha with alpha "
            f"{decoding.length_penalty}, at most source length + 50 output tokens, early termination (§6.1), all "
            "in generation_config.json. transformers' own penalty (score / |Y|^alpha) instead: "
            '`model.generate(..., length_penalty_type="power")`.'
        ),
    )
    return write_text(model_dir / "README.md", card)
