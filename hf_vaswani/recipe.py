"""From a parallel corpus to a trained, averaged, scored and Hub-ready model folder with the paper's recipe."""

import json
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from string import Template

from datasets import DatasetDict
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase, set_seed

from . import save_model_folder
from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import paper_generation_config
from .inference import translate_and_score
from .modeling_vaswani import VaswaniForConditionalGeneration
from .plots import plot_training_curves
from .tokenization import train_shared_bpe_from_dataset
from .training import CheckpointAveragingCallback, VaswaniTrainer, paper_training_arguments, tokenize_corpus

PRESETS = {"base": VaswaniConfig.base, "big": VaswaniConfig.big}


@dataclass
class RecipeSettings:
    """The knobs of §5 and §6.1; defaults are the paper's base model on WMT14 En-De."""

    preset: str = "base"
    model_overrides: dict = field(default_factory=dict)
    vocab_size: int = 37000
    max_tokens: int = 25000
    update_freq: int = 1
    warmup_steps: int = 4000
    max_steps: int = 100000
    label_smoothing: float = 0.1
    average_last: int = 5
    save_steps: int = 1000
    logging_steps: int = 100
    num_beams: int = 4
    length_penalty: float = 0.6
    eval_batch_size: int = 64
    seed: int = 0
    bf16: bool = False
    fp16: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
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
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_steps // self.save_steps < self.average_last:
            raise ValueError(
                f"averaging the last {self.average_last} checkpoints needs max_steps ({self.max_steps}) >= "
                f"average_last * save_steps ({self.average_last * self.save_steps})"
            )


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
    """The preset with the tokenizer's vocabulary and special ids, and the paper's decoding as generation defaults."""
    config = PRESETS[settings.preset](
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        label_smoothing=settings.label_smoothing,
        **settings.model_overrides,
    )
    model = VaswaniForConditionalGeneration(config)
    model.generation_config = paper_generation_config(
        config, num_beams=settings.num_beams, length_penalty=settings.length_penalty
    )
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

    tokenizer = train_shared_bpe_from_dataset(corpus["train"], vocab_size=settings.vocab_size)
    set_seed(settings.seed)  # the initial weights too are a function of the seed
    model = build_model(settings, tokenizer)
    tokenized = tokenize_corpus(corpus["train"], tokenizer)
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
    """Fill the package's model_card.md template into `model_dir/README.md` (the Hub's model card)."""
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
        ("beam size / length penalty alpha", "4 / 0.6", f"{settings.num_beams} / {settings.length_penalty}"),
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
            f"beam {settings.num_beams}, GNMT length penalty ((5 + |Y|) / 6)^alpha with alpha "
            f"{settings.length_penalty}, at most source length + 50 output tokens, early termination (§6.1), all "
            "in generation_config.json. transformers' own penalty (score / |Y|^alpha) instead: "
            '`model.generate(..., length_penalty_type="power")`.'
        ),
    )
    path = model_dir / "README.md"
    path.write_text(card)
    return path
