"""From a parallel corpus to a trained, averaged, scored and Hub-ready model folder with the paper's recipe."""

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from datasets import DatasetDict
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, PreTrainedTokenizerBase, set_seed

from . import save_model_folder
from .bpe_dropout import BpeDropoutPairs
from .callbacks import CheckpointAveragingCallback, ValidationBleuCallback, best_validation
from .checkpoints import newest_complete_checkpoint
from .cpu_kernels import kernelize
from .files import replace_folder, write_text
from .generation_vaswani import paper_generation_config
from .model_card import cpu_model_name, write_model_card
from .modeling_vaswani import VaswaniForConditionalGeneration
from .plots import plot_training_curves
from .precision import training_precision
from .run_folder import RUN_RECORD, TOKENIZER_FOLDER, check_output_dir, corpus_fingerprint, is_main_process, remove_run
from .schedule import TrainingTimeBudgetCallback
from .scoring import translate_and_score
from .settings import RecipeSettings, model_config, setting_flag
from .tokenization import train_shared_bpe_from_dataset
from .trainer import VaswaniTrainer, paper_training_arguments, tokenize_corpus

VALIDATION_SCORES = ("eval_bleu", "eval_lowercased_tokenized_bleu")  # what ValidationBleuCallback logs


def build_model(settings: RecipeSettings, tokenizer: PreTrainedTokenizerBase) -> VaswaniForConditionalGeneration:
    """The configured model with the tokenizer's vocabulary and special ids, and the settings' decoding, its CPU
    kernels attached (`kernelize`).

    The model's generation config is the paper's (§6.1; a new model has transformers' defaults), with the decoding
    settings given on top; the checkpoints and the final model folder carry it.
    """
    config = model_config(
        settings,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = kernelize(VaswaniForConditionalGeneration(config))
    decoding = {
        name: value for name in ("num_beams", "length_penalty") if (value := getattr(settings, name)) is not None
    }
    model.generation_config = paper_generation_config(config, **decoding)
    return model


def run_recipe(
    corpus: DatasetDict,
    output_dir: str | Path,
    settings: RecipeSettings,
    source_lang: str = "en",
    target_lang: str = "de",
    dataset_name: str = "custom",
    resume: bool = False,
    overwrite: bool = False,
    command: str = "hf_vaswani.recipe.run_recipe",
) -> dict:
    """Train tokenizer and model, average the last checkpoints, translate the test split and write everything.

    Writes `output_dir/run.json` (settings and corpus fingerprint) and `output_dir/tokenizer` first, the checkpoints
    under `output_dir/checkpoints`, then `output_dir/model` (Hub-ready: weights, tokenizer, generation config, model
    card, remote code), `output_dir/results.json` and `output_dir/training_curves.png`; the model folder, results and
    averaged weights each appear whole or not at all. A folder holding a previous run is refused unless `resume` or
    `overwrite` says what to do with it (`check_output_dir`). With `resume`, training continues from the newest complete
    checkpoint there (weights, optimizer, schedule, data position and random state) with the run's tokenizer, ending
    where an uninterrupted run would; a different training corpus is refused.
    """
    for split in ("train", "test") + (("validation",) if settings.eval_bleu_steps else ()):
        if split not in corpus:
            raise ValueError(f"the corpus has no {split!r} split (has {sorted(corpus)})")
    output_dir = Path(output_dir)
    started = time.perf_counter()
    previous_run = check_output_dir(output_dir, settings, resume, overwrite)
    fingerprint = corpus_fingerprint(corpus["train"])
    if previous_run and previous_run["train_corpus_sha256"] != fingerprint:
        raise ValueError(
            f"--resume: the training corpus is not the one the run in {output_dir} started with (sha256 "
            f"{previous_run['train_corpus_sha256'][:12]}... then, {fingerprint[:12]}... now)"
        )
    if settings.max_train_minutes is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"{setting_flag('max_train_minutes')} times one process; with several, use --max-steps")
    if settings.bpe_dropout is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"{setting_flag('bpe_dropout')} segments in one process; with several, train without it")
    precision = training_precision(settings)
    # Before the tokenizer and the model: the arguments check the machine (bf16 on this CPU) without training anything.
    args = paper_training_arguments(
        output_dir / "checkpoints",
        max_steps=settings.max_steps,
        warmup_steps=settings.warmup_steps,
        learning_rate=settings.learning_rate_scale,  # VaswaniTrainer multiplies Eq. 3 by it
        gradient_accumulation_steps=settings.update_freq,
        save_steps=settings.save_steps,
        save_total_limit=checkpoints_to_keep(settings),
        logging_steps=settings.logging_steps,
        seed=settings.seed,
        data_seed=settings.seed,
        full_determinism=settings.full_determinism,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        dataloader_num_workers=0,
    )
    if overwrite and is_main_process():
        remove_run(output_dir)
    tokenizer_dir = output_dir / TOKENIZER_FOLDER
    if resume and tokenizer_dir.is_dir():
        # the run's own vocabulary: a retrained BPE could give the weights other ids
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    else:
        tokenizer = train_shared_bpe_from_dataset(corpus["train"], vocab_size=settings.vocab_size)
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        # The record first: a run killed before its tokenizer is saved resumes by training the same one again.
        record = {"settings": asdict(settings), "train_corpus_sha256": fingerprint, "train_pairs": len(corpus["train"])}
        write_text(output_dir / RUN_RECORD, json.dumps(record, indent=2) + "\n")
        if not tokenizer_dir.is_dir():
            replace_folder(tokenizer_dir, tokenizer.save_pretrained)
    set_seed(settings.seed)  # the initial weights too are a function of the seed
    model = build_model(settings, tokenizer)
    if settings.bpe_dropout is None:
        tokenized = tokenize_corpus(corpus["train"], tokenizer)
    else:
        tokenized = BpeDropoutPairs(
            corpus["train"]["source"], corpus["train"]["target"], tokenizer, settings.bpe_dropout
        )
    averaging = CheckpointAveragingCallback(
        settings.average_last, end_at_best_validation=settings.early_stopping_patience is not None
    )
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        max_tokens=settings.max_tokens,
        cooldown_steps=settings.cooldown_steps,
        callbacks=[averaging],
    )
    if settings.max_train_minutes is not None:
        trainer.add_callback(TrainingTimeBudgetCallback(settings.max_train_minutes))
    validation = None
    if settings.eval_bleu_steps:
        pairs = corpus["validation"]
        if settings.eval_bleu_sample:
            pairs = pairs.select(range(min(settings.eval_bleu_sample, len(pairs))))
        validation = ValidationBleuCallback(
            tokenizer,
            pairs["source"],
            pairs["target"],
            target_lang,
            settings.eval_bleu_steps,
            log=trainer.log,
            num_beams=settings.eval_bleu_num_beams,
            batch_size=settings.eval_batch_size,
            early_stopping_patience=settings.early_stopping_patience,
        )
        trainer.add_callback(validation)
    # Only the main process moves incomplete checkpoints aside; the others skip them where it has not yet.
    checkpoint = newest_complete_checkpoint(args.output_dir, move_aside=is_main_process()) if resume else None
    train_output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    train_seconds = time.perf_counter() - started
    if not trainer.is_world_process_zero():
        return {}

    # The averaged folder carries the last checkpoint's generation config (the paper's decoding).
    model = kernelize(VaswaniForConditionalGeneration.from_pretrained(averaging.averaged_path).to(trainer.args.device))
    sources, references = corpus["test"]["source"], corpus["test"]["target"]
    hypotheses, scores = translate_and_score(
        model, tokenizer, sources, references, target_lang, batch_size=settings.eval_batch_size
    )

    results = {
        "bleu": round(scores["bleu"], 2),
        "chrf": round(scores["chrf"], 2),
        "tokenized_bleu": round(scores["tokenized_bleu"], 2),
        "lowercased_tokenized_bleu": round(scores["lowercased_tokenized_bleu"], 2),
        "bleu_signature": scores["bleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        "lowercased_tokenized_bleu_signature": scores["lowercased_tokenized_bleu_signature"],
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "steps": train_output.global_step,
        "final_training_loss": round(train_output.training_loss, 4),
        "training_precision": precision,
        "parameters": model.num_parameters(),
        "test_sentences": len(sources),
        "averaged_checkpoints": [checkpoint.name for checkpoint in averaging.checkpoints],
        "validation": validation_summary(trainer.state.log_history) if validation else None,
        "settings": asdict(settings),
        # scores of a seeded run differ slightly between CPU models (kernels differ in the last bits): say which one
        "cpu": cpu_model_name(),
        "command": command,
        # what the settings left to the preset and the paper, as the saved config and generation config hold it
        "label_smoothing": model.config.label_smoothing,
        "num_beams": model.generation_config.num_beams,
        "length_penalty": model.generation_config.length_penalty,
        "examples": [
            {"source": s, "reference": r, "translation": h}
            for s, r, h in list(zip(sources, references, hypotheses, strict=True))[:5]
        ],
    }
    model_dir = output_dir / "model"

    def write_model_folder(folder: Path) -> None:
        save_model_folder(model, tokenizer, folder)
        card_fields = (model.config, settings, results, source_lang, target_lang, dataset_name, sources[0])
        write_model_card(folder, *card_fields, model_name=model_dir.name)

    replace_folder(model_dir, write_model_folder)
    write_text(output_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    plot_training_curves(trainer.state.log_history, output_dir / "training_curves.png")
    return results


def validation_summary(log_history: list[dict]) -> dict:
    """Validation BLEU (greedy unless eval_bleu_num_beams) at every evaluation and the step where it was best."""
    curve = [
        {key: round(entry[key], 2) for key in ("step", "elapsed_minutes", *VALIDATION_SCORES)}
        for entry in log_history
        if VALIDATION_SCORES[0] in entry
    ]
    best = best_validation(log_history)
    return {
        "best_step": best["step"] if best else None,
        "best_bleu": round(best[VALIDATION_SCORES[0]], 2) if best else None,
        "curve": curve,
    }


def checkpoints_to_keep(settings: RecipeSettings) -> int:
    """Checkpoints the run keeps on disk (Trainer's `save_total_limit`): those averaged, and with early stopping also
    those saved after the best step until training stops (`patience` evaluations, each a checkpoint every
    `save_steps`, plus the one saved at the stop), so that the average can end at the best step."""
    if settings.early_stopping_patience is None:
        return settings.average_last
    saves_per_evaluation = -(-settings.eval_bleu_steps // settings.save_steps)
    return settings.average_last + settings.early_stopping_patience * saves_per_evaluation + 1
