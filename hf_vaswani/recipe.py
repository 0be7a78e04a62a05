"""From a parallel corpus to a trained, averaged, scored and Hub-ready model folder with the paper's recipe."""

import difflib
import inspect
import json
import time
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from datasets import DatasetDict
from huggingface_hub.errors import StrictDataclassError
from transformers import DataCollatorForSeq2Seq, GenerationConfig, PreTrainedTokenizerBase, set_seed

from . import save_model_folder
from .configuration_vaswani import VaswaniConfig
from .inference import translate_and_score
from .modeling_vaswani import VaswaniForConditionalGeneration
from .plots import plot_training_curves
from .tokenization import train_shared_bpe_from_dataset
from .training import CheckpointAveragingCallback, VaswaniTrainer, paper_training_arguments, tokenize_corpus

PRESETS = {"base": VaswaniConfig.base, "big": VaswaniConfig.big}
# VaswaniConfig fields the recipe takes from the tokenizer it trains, with the setting that controls them (None: none).
TOKENIZER_FIELDS = {
    "vocab_size": "vocab_size",
    "source_vocab_size": "vocab_size",  # the recipe trains one shared vocabulary
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "decoder_start_token_id": None,
}
# What a model override may set: VaswaniConfig's own fields (not transformers' generic ones) but the tokenizer's.
OVERRIDABLE_FIELDS = tuple(name for name in inspect.get_annotations(VaswaniConfig) if name not in TOKENIZER_FIELDS)


@dataclass
class RecipeSettings:
    """The knobs of §5 and §6.1; defaults are the paper's base model on WMT14 En-De.

    Each field is one `vaswani train` option, generated from it: `--` and the name with dashes (or the metadata's
    "flag"), the field's type and default, and the rest of its metadata as argparse keywords (help, choices, metavar).
    Invalid values and combinations that could not finish are refused here, before any work starts.
    """

    preset: str = field(default="base", metadata={"help": "Table 3's model", "choices": sorted(PRESETS)})
    model_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "flag": "--model-override",
            "metavar": "KEY=VALUE",
            "help": "set a VaswaniConfig field of the preset, e.g. d_model=256 or label_smoothing=0.2; VALUE is read "
            "as JSON when it parses (repeatable; a later KEY wins)",
        },
    )
    vocab_size: int = field(default=37000, metadata={"help": "size of the shared BPE vocabulary trained (§5.1)"})
    max_tokens: int = field(
        default=25000, metadata={"help": "tokens of one process's batch on each side, padding included (§5.1)"}
    )
    update_freq: int = field(default=1, metadata={"help": "batches accumulated into one optimizer step"})
    warmup_steps: int = field(default=4000, metadata={"help": "warmup steps of the learning rate, Eq. 3 (§5.3)"})
    max_steps: int = field(default=100000, metadata={"help": "optimizer steps to train"})
    average_last: int = field(default=5, metadata={"help": "checkpoints averaged into the final model (§6.1)"})
    save_steps: int = field(default=1000, metadata={"help": "optimizer steps between checkpoints"})
    logging_steps: int = field(
        default=100, metadata={"help": "optimizer steps between logged training losses; at most --max-steps"}
    )
    num_beams: int | None = field(
        default=None, metadata={"help": "beam size in generation_config.json; None means the paper's (4, §6.1)"}
    )
    length_penalty: float | None = field(
        default=None, metadata={"help": "GNMT alpha in generation_config.json; None means the paper's (0.6, §6.1)"}
    )
    eval_batch_size: int = field(default=64, metadata={"help": "sentences per batch when translating the test split"})
    seed: int = field(
        default=0, metadata={"help": "seed of the initial weights, data order and dropout (and the embedded corpus)"}
    )
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision"})
    fp16: bool = field(default=False, metadata={"help": "fp16 mixed precision with loss scaling (GPU)"})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"{setting_flag('preset')} must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for name in (
            "vocab_size",
            "max_tokens",
            "update_freq",
            "warmup_steps",
            "max_steps",
            "average_last",
            "save_steps",
            "logging_steps",
            "num_beams",
            "eval_batch_size",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{setting_flag(name)} must be positive, got {value}")
        if self.bf16 and self.fp16:
            raise ValueError(f"{setting_flag('bf16')} and {setting_flag('fp16')} exclude each other")
        if self.logging_steps > self.max_steps:
            raise ValueError(
                f"{setting_flag('logging_steps')} ({self.logging_steps}) is larger than {setting_flag('max_steps')} "
                f"({self.max_steps}): no training loss would be logged for the training curves"
            )
        if self.max_steps // self.save_steps < self.average_last:
            raise ValueError(
                f"averaging the last {self.average_last} checkpoints ({setting_flag('average_last')}) needs "
                f"{setting_flag('max_steps')} ({self.max_steps}) >= {setting_flag('average_last')} * "
                f"{setting_flag('save_steps')} ({self.average_last * self.save_steps})"
            )
        for key in self.model_overrides:
            if key in TOKENIZER_FIELDS:
                setting = TOKENIZER_FIELDS[key]
                instead = f"set it with {setting_flag(setting)}" if setting else "it cannot be overridden"
                raise ValueError(
                    f"{setting_flag('model_overrides')} {key}: the recipe takes it from the tokenizer it trains; "
                    + instead
                )
            if key not in OVERRIDABLE_FIELDS:
                close = difflib.get_close_matches(key, OVERRIDABLE_FIELDS, n=1)
                hint = f"did you mean {close[0]}?" if close else f"the fields are {', '.join(OVERRIDABLE_FIELDS)}"
                raise ValueError(f"{setting_flag('model_overrides')} {key}: VaswaniConfig has no such field ({hint})")
        model_config(self)  # the preset with the overrides, its vocabulary a placeholder: refuses bad values now


def setting_flag(name: str) -> str:
    """The `vaswani train` option of the RecipeSettings field `name`."""
    metadata = next(setting.metadata for setting in fields(RecipeSettings) if setting.name == name)
    return metadata.get("flag", "--" + name.replace("_", "-"))


def model_config(settings: RecipeSettings, **tokenizer_fields: int) -> VaswaniConfig:
    """The preset with the settings' overrides and the tokenizer's fields; a config error as one ValueError line."""
    try:
        return PRESETS[settings.preset](**tokenizer_fields, **settings.model_overrides)
    except (ValueError, StrictDataclassError) as error:  # strict's type errors are no ValueErrors
        message = " ".join(str(error).split())
        raise ValueError(f"VaswaniConfig refuses the settings: {message}") from error


# The main job on the embedded corpus: a small model that reaches BLEU > 90 within minutes on a 2-core CPU.
DEMO_SETTINGS = RecipeSettings(
    preset="base",
    model_overrides=dict(d_model=128, d_ff=512, num_heads=4, encoder_layers=3, decoder_layers=3),
    vocab_size=2000,
    max_tokens=2048,
    warmup_steps=400,
    max_steps=1500,
    save_steps=100,
    logging_steps=25,
    average_last=5,
    eval_batch_size=100,
)


def build_model(settings: RecipeSettings, tokenizer: PreTrainedTokenizerBase) -> VaswaniForConditionalGeneration:
    """The configured model with the tokenizer's vocabulary and special ids, and the settings' decoding.

    The model's generation config starts as the paper's (the model sets it); only the decoding settings given go on top.
    """
    config = model_config(
        settings,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = VaswaniForConditionalGeneration(config)
    decoding = {
        name: value for name in ("num_beams", "length_penalty") if (value := getattr(settings, name)) is not None
    }
    model.generation_config.update(**decoding)
    return model


def run_recipe(
    corpus: DatasetDict,
    output_dir: str | Path,
    settings: RecipeSettings,
    source_lang: str = "en",
    target_lang: str = "de",
    dataset_name: str = "custom",
    resume: bool = False,
) -> dict:
    """Train tokenizer and model, average the last checkpoints, translate the test split and write everything.

    Writes `output_dir/model` (Hub-ready: weights, tokenizer, generation config, model card, remote code),
    `output_dir/results.json`, `output_dir/training_curves.png` and the checkpoints under `output_dir/checkpoints`.
    With `resume`, training continues from the last checkpoint there (weights, optimizer, schedule, data position and
    random state), ending where an uninterrupted run would.
    """
    for split in ("train", "test"):
        if split not in corpus:
            raise ValueError(f"the corpus has no {split!r} split (has {sorted(corpus)})")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Before the tokenizer and the model: the arguments check the machine (bf16 on this CPU) without training anything.
    args = paper_training_arguments(
        output_dir / "checkpoints",
        max_steps=settings.max_steps,
        warmup_steps=settings.warmup_steps,
        gradient_accumulation_steps=settings.update_freq,
        save_steps=settings.save_steps,
        save_total_limit=settings.average_last,
        logging_steps=settings.logging_steps,
        seed=settings.seed,
        data_seed=settings.seed,
        bf16=settings.bf16,
        fp16=settings.fp16,
        dataloader_num_workers=0,
    )
    tokenizer = train_shared_bpe_from_dataset(corpus["train"], vocab_size=settings.vocab_size)
    set_seed(settings.seed)  # the initial weights too are a function of the seed
    model = build_model(settings, tokenizer)
    tokenized = tokenize_corpus(corpus["train"], tokenizer)
    averaging = CheckpointAveragingCallback(settings.average_last)
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        max_tokens=settings.max_tokens,
        callbacks=[averaging],
    )
    has_checkpoint = resume and any((output_dir / "checkpoints").glob("checkpoint-*"))
    train_output = trainer.train(resume_from_checkpoint=True if has_checkpoint else None)
    train_seconds = time.perf_counter() - started
    if not trainer.is_world_process_zero():
        return {}

    # The averaged folder carries the last checkpoint's generation config (the paper's decoding).
    model = VaswaniForConditionalGeneration.from_pretrained(averaging.averaged_path).to(trainer.args.device)
    sources, references = corpus["test"]["source"], corpus["test"]["target"]
    hypotheses, scores = translate_and_score(
        model, tokenizer, sources, references, target_lang, batch_size=settings.eval_batch_size
    )

    model_dir = output_dir / "model"
    save_model_folder(model, tokenizer, model_dir)
    results = {
        "bleu": round(scores["bleu"], 2),
        "chrf": round(scores["chrf"], 2),
        "tokenized_bleu": round(scores["tokenized_bleu"], 2),
        "bleu_signature": scores["bleu_signature"],
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "steps": train_output.global_step,
        "final_training_loss": round(train_output.training_loss, 4),
        "parameters": model.num_parameters(),
        "test_sentences": len(sources),
        "averaged_checkpoints": settings.average_last,
        "settings": asdict(settings),
        # what the settings left to the preset and the paper, as the saved config and generation config hold it
        "label_smoothing": model.config.label_smoothing,
        "num_beams": model.generation_config.num_beams,
        "length_penalty": model.generation_config.length_penalty,
        "examples": [
            {"source": s, "reference": r, "translation": h}
            for s, r, h in list(zip(sources, references, hypotheses, strict=True))[:5]
        ],
    }
    write_model_card(model_dir, model.config, settings, results, source_lang, target_lang, dataset_name, sources[0])
    (output_dir / "results.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    plot_training_curves(trainer.state.log_history, output_dir / "training_curves.png")
    return results


def write_model_card(
    model_dir: Path,
    config: VaswaniConfig,
    settings: RecipeSettings,
    results: dict,
    source_lang: str,
    target_lang: str,
    dataset_name: str,
    example_source: str,
) -> Path:
    """Fill the package's model_card.md template into `model_dir/README.md` (the Hub's model card).

    The decoding it describes is the one saved in `model_dir/generation_config.json`.
    """
    decoding = GenerationConfig.from_pretrained(model_dir)
    rows = [
        ("layers N (encoder / decoder)", "6 / 6", f"{config.encoder_layers} / {config.decoder_layers}"),
        ("d_model / d_ff / heads h", "512 / 2048 / 8", f"{config.d_model} / {config.d_ff} / {config.num_heads}"),
        ("d_k / d_v", "64 / 64", f"{config.d_k} / {config.d_v}"),
        ("dropout P_drop / label smoothing", "0.1 / 0.1", f"{config.dropout} / {config.label_smoothing}"),
        ("shared BPE vocabulary", "~37000", str(config.vocab_size)),
        ("batch (tokens per side)", "~25000", f"{settings.max_tokens} x update_freq {settings.update_freq}"),
        ("optimizer", "Adam(0.9, 0.98, 1e-9)", "Adam(0.9, 0.98, 1e-9)"),
        ("warmup steps / training steps", "4000 / 100000", f"{settings.warmup_steps} / {results['steps']}"),
        ("checkpoints averaged", "last 5", f"last {settings.average_last}"),
        ("beam size / length penalty alpha", "4 / 0.6", f"{decoding.num_beams} / {decoding.length_penalty}"),
    ]
    deviations = [name for name, paper, ours in rows if paper != ours]
    template = Template(resources.files("hf_vaswani").joinpath("model_card.md").read_text())
    card = template.substitute(
        source_lang=source_lang,
        target_lang=target_lang,
        dataset=dataset_name,
        dataset_title=dataset_name,
        model_name=model_dir.name,
        bleu=results["bleu"],
        chrf=results["chrf"],
        tokenized_bleu=results["tokenized_bleu"],
        bleu_signature=results["bleu_signature"],
        example_source=example_source.replace('"', '\\"'),
        settings_table="\n".join(f"| {name} | {paper} | {ours} |" for name, paper, ours in rows),
        deviations=", ".join(deviations) + "." if deviations else "none.",
        decoding=(
            f"beam {decoding.num_beams}, GNMT length penalty ((5 + |Y|) / 6)^alpha with alpha "
            f"{decoding.length_penalty}, at most source length + 50 output tokens, early termination (§6.1), all "
            "in generation_config.json. transformers' own penalty (score / |Y|^alpha) instead: "
            '`model.generate(..., length_penalty_type="power")`.'
        ),
    )
    path = model_dir / "README.md"
    path.write_text(card)
    return path
