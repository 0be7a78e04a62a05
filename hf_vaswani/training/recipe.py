"""From a parallel corpus to a trained, averaged, scored and Hub-ready model folder with the paper's recipe."""

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from datasets import DatasetDict
from transformers import (
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerBase,
    Seq2SeqTrainingArguments,
    TrainerState,
    set_seed,
)

from .. import save_model_folder
from ..data.bpe_dropout import BpeDropoutPairs, check_one_process
from ..data.tokenization import load_trained_bpe, train_shared_bpe_from_dataset
from ..decoding.scoring import translate_and_score
from ..decoding.shortlist import SHORTLIST_FREQUENT, SHORTLIST_PER_SOURCE, shortlist_of_corpus
from ..decoding.translation import Translator
from ..files import copy_missing_entries, replace_folder, write_text
from ..gpu_policy import batch_loader_workers, compile_mode, compiles, uses_tf32
from ..interop.model_card import write_model_card
from ..kernels.cpu import kernelize
from ..machine import cpu_model_name, gpu_name
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import paper_generation_config
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..plots import plot_training_curves
from .callbacks import (
    VALIDATION_LOSS_KEYS,
    CheckpointAveragingCallback,
    ValidationBleuCallback,
    ValidationLossCallback,
    best_validation,
    best_validation_loss,
)
from .checkpoints import TRAINER_STATE, newest_complete_checkpoint, training_ended
from .precision import training_precision
from .run_folder import (
    RUN_RECORD,
    TOKENIZER_FOLDER,
    corpus_fingerprint,
    is_main_process,
    prepared_run_folder,
    remove_run,
    run_has_ended,
)
from .schedule import TrainingTimeBudgetCallback
from .settings import RecipeSettings, model_config, setting_flag
from .trainer import TrainingDiverged, VaswaniTrainer, paper_training_arguments, tokenize_corpus

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
        name: value
        for name in ("num_beams", "length_penalty", "length_penalty_type")
        if (value := getattr(settings, name)) is not None
    }
    model.generation_config = paper_generation_config(config, **decoding)
    return model


@dataclass(frozen=True)
class RecipeRun:
    """One run of the recipe: its folder and settings, what to do with a run already there, and what its model card
    and results record about it."""

    output_dir: Path
    settings: RecipeSettings
    resume: bool = False
    overwrite: bool = False
    source_lang: str = "en"
    target_lang: str = "de"
    dataset_name: str = "custom"
    command: str = "hf_vaswani.training.recipe.run_recipe"


def run_recipe(
    corpus: DatasetDict,
    output_dir: str | Path,
    settings: RecipeSettings,
    source_lang: str = "en",
    target_lang: str = "de",
    dataset_name: str = "custom",
    resume: bool = False,
    overwrite: bool = False,
    command: str = "hf_vaswani.training.recipe.run_recipe",
) -> dict:
    """Train tokenizer and model, average the last checkpoints, translate the test split and write everything.

    Writes `output_dir/run.json` (settings and corpus fingerprint) and `output_dir/tokenizer` first, the checkpoints
    under `output_dir/checkpoints`, then `output_dir/model` (Hub-ready: weights, tokenizer, generation config, model
    card, remote code), `output_dir/results.json` and `output_dir/training_curves.png`; the model folder, results and
    averaged weights each appear whole or not at all. A folder holding a previous run is refused unless `resume` or
    `overwrite` says what to do with it (`check_output_dir`). With `resume`, training continues from the newest complete
    checkpoint there (weights, optimizer, schedule, data position and random state) with the run's tokenizer; a
    different training corpus is refused.
    """
    run = RecipeRun(Path(output_dir), settings, resume, overwrite, source_lang, target_lang, dataset_name, command)
    return run_in_folder(run, lambda: corpus)


def run_in_folder(run: RecipeRun, load_corpus: Callable[[], DatasetDict]) -> dict:
    """`run` in its output folder, held and checked (`prepared_run_folder`) before `load_corpus` reads the corpus: a
    folder another run holds, or a run there without `resume` or `overwrite`, is refused before any work."""
    with prepared_run_folder(run.output_dir, run.settings, run.resume, run.overwrite) as previous_run:
        return train_and_write(load_corpus(), run, previous_run)


def train_and_write(corpus: DatasetDict, run: RecipeRun, previous_run: dict | None) -> dict:
    """`run_recipe`'s steps, in the output folder held and checked for it (`prepared_run_folder`, which gives
    `previous_run`): the results; {} in a process other than the main one, and where the run has ended already with
    these settings, which it says in one line, changing nothing."""
    started = time.perf_counter()
    fingerprint = check_corpus(corpus, run, previous_run)
    if previous_run is not None and run_has_ended(run.output_dir, previous_run, run.settings):
        print(f"{run.output_dir}: the run has ended with these settings; nothing to do (its results: results.json)")
        return {}
    precision = training_precision(run.settings)
    # Before the tokenizer and the model: the arguments check the machine (bf16 on this CPU) without training anything.
    args = training_arguments(run.settings, run.output_dir / "checkpoints", precision)
    if run.overwrite and is_main_process():
        remove_run(run.output_dir)
    tokenizer = run_tokenizer(corpus, run, fingerprint)
    trainer, averaging = recipe_trainer(corpus, run, tokenizer, args)
    train(trainer, averaging, run.resume)
    train_seconds = time.perf_counter() - started
    if not trainer.is_world_process_zero():
        return {}
    # The averaged folder carries the last checkpoint's generation config (the paper's decoding).
    model = kernelize(VaswaniForConditionalGeneration.from_pretrained(averaging.averaged_path).to(trainer.args.device))
    if not all(parameter.isfinite().all() for parameter in model.parameters()):  # diverged after the last check
        raise TrainingDiverged(
            f"training diverged: the average of {', '.join(path.name for path in averaging.checkpoints)} holds "
            "non-finite weights; no model is written"
        )
    results = scored_results(corpus, run, model, tokenizer, trainer, averaging, precision, train_seconds)
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    write_run_outputs(corpus, run, model, tokenizer, results, trainer.state.log_history)
    return results


def check_corpus(corpus: DatasetDict, run: RecipeRun, previous_run: dict | None) -> str:
    """Refuses a corpus without the splits the settings use, or, on resuming, another training corpus than the run's;
    also a setting that runs in one process only, under several. Gives the training corpus' fingerprint."""
    settings = run.settings
    validates = settings.eval_bleu_steps or settings.early_stopping_metric == "loss"
    for split in ("train", "test") + (("validation",) if validates else ()):
        if split not in corpus:
            raise UsageError(f"the corpus has no {split!r} split (has {sorted(corpus)})")
    fingerprint = corpus_fingerprint(corpus["train"])
    if previous_run and previous_run["train_corpus_sha256"] != fingerprint:
        raise UsageError(
            f"--resume: the training corpus is not the one the run in {run.output_dir} started with (sha256 "
            f"{previous_run['train_corpus_sha256'][:12]}... then, {fingerprint[:12]}... now)"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if settings.max_train_minutes is not None and world_size > 1:
        raise UsageError(f"{setting_flag('max_train_minutes')} times one process; with several, use --max-steps")
    if settings.bpe_dropout is not None:
        check_one_process(world_size)
    return fingerprint


def run_tokenizer(corpus: DatasetDict, run: RecipeRun, fingerprint: str) -> PreTrainedTokenizerBase:
    """The shared BPE vocabulary (§5.1): the run's own when resuming, else trained on the corpus; saved with the run's
    record by the main process."""
    tokenizer_dir = run.output_dir / TOKENIZER_FOLDER
    if run.resume and tokenizer_dir.is_dir():
        # the run's own vocabulary (a retrained BPE could give the weights other ids), saving as it did before
        tokenizer = load_trained_bpe(tokenizer_dir)
    else:
        settings = run.settings
        tokenizer = train_shared_bpe_from_dataset(
            corpus["train"], vocab_size=settings.vocab_size, kind=settings.bpe, merges=settings.bpe_merges
        )
    if is_main_process():
        run.output_dir.mkdir(parents=True, exist_ok=True)
        # The record first: a run killed before its tokenizer is saved resumes by training the same one again.
        record = {
            "settings": asdict(run.settings),
            "train_corpus_sha256": fingerprint,
            "train_pairs": len(corpus["train"]),
        }
        write_text(run.output_dir / RUN_RECORD, json.dumps(record, indent=2) + "\n")
        if not tokenizer_dir.is_dir():
            replace_folder(tokenizer_dir, tokenizer.save_pretrained)
    return tokenizer


def recipe_trainer(
    corpus: DatasetDict, run: RecipeRun, tokenizer: PreTrainedTokenizerBase, args: Seq2SeqTrainingArguments
) -> tuple[VaswaniTrainer, CheckpointAveragingCallback]:
    """The seeded model and its trainer with the run's callbacks: averaging, the time budget, validation."""
    settings = run.settings
    set_seed(settings.seed)  # the initial weights too are a function of the seed
    model = build_model(settings, tokenizer)
    if settings.bpe_dropout is None:
        tokenized = tokenize_corpus(corpus["train"], tokenizer)
    else:
        tokenized = BpeDropoutPairs(
            corpus["train"]["source"], corpus["train"]["target"], tokenizer, settings.bpe_dropout
        )
    bleu_patience = settings.early_stopping_patience if settings.early_stopping_metric == "bleu" else None
    averaging = CheckpointAveragingCallback(settings.average_last, end_at_best_validation=bleu_patience is not None)
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
    if settings.eval_bleu_steps:
        pairs = corpus["validation"]
        if settings.eval_bleu_sample:
            pairs = pairs.select(range(min(settings.eval_bleu_sample, len(pairs))))
        validation = ValidationBleuCallback(
            tokenizer,
            pairs["source"],
            pairs["target"],
            run.target_lang,
            settings.eval_bleu_steps,
            log=trainer.log,
            num_beams=settings.eval_bleu_num_beams,
            batch_size=settings.eval_batch_size,
            early_stopping_patience=bleu_patience,
        )
        trainer.add_callback(validation)
    if settings.early_stopping_metric == "loss":  # last: it validates at the checkpoints the callbacks above ask for
        trainer.add_callback(
            ValidationLossCallback(
                tokenize_corpus(corpus["validation"], tokenizer),
                trainer.data_collator,
                settings.max_tokens,
                settings.label_smoothing,
                log=trainer.log,
                early_stopping_patience=settings.early_stopping_patience,
            )
        )
    if settings.save_every_epoch:
        check_epoch_checkpoints(
            settings,
            updates_per_epoch=math.ceil(len(trainer.get_train_dataloader()) / args.gradient_accumulation_steps),
        )
    return trainer, averaging


def train(trainer: VaswaniTrainer, averaging: CheckpointAveragingCallback, resume: bool) -> None:
    """Training, from the newest complete checkpoint when resuming, and the averaging of the last checkpoints."""
    # Only the main process moves incomplete checkpoints aside; the others skip them where it has not yet.
    checkpoint = newest_complete_checkpoint(trainer.args.output_dir, move_aside=is_main_process()) if resume else None
    if checkpoint is not None and training_ended(checkpoint):
        # Only the end is left to do. Trainer would take a step past the end from a checkpoint saved mid-epoch.
        trainer.state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE))
        if trainer.is_world_process_zero():
            averaging.on_train_end(trainer.args, trainer.state, trainer.control)
    else:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)


def scored_results(
    corpus: DatasetDict,
    run: RecipeRun,
    model: VaswaniForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    trainer: VaswaniTrainer,
    averaging: CheckpointAveragingCallback,
    precision: str,
    train_seconds: float,
) -> dict:
    """The averaged model's test scores (§6.1 decoding), with what the run did and on which machine."""
    settings = run.settings
    sources, references = corpus["test"]["source"], corpus["test"]["target"]
    with Translator(model, tokenizer) as translator:
        hypotheses, scores = translate_and_score(
            translator, sources, references, run.target_lang, batch_size=settings.eval_batch_size
        )
    log_history = trainer.state.log_history
    return {
        "bleu": round(scores["bleu"], 2),
        "chrf": round(scores["chrf"], 2),
        "tokenized_bleu": round(scores["tokenized_bleu"], 2),
        "lowercased_tokenized_bleu": round(scores["lowercased_tokenized_bleu"], 2),
        "bleu_signature": scores["bleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        "lowercased_tokenized_bleu_signature": scores["lowercased_tokenized_bleu_signature"],
        # fairseq's BLEU on whitespace tokens: the published Multi30k number when the text was prepared for it
        "whitespace_bleu": round(scores["whitespace_bleu"], 2),
        "train_seconds": round(train_seconds, 1),
        "steps": trainer.state.global_step,
        # the last logged, not Trainer's mean over this process's steps, which a resumed run would cut short
        "final_training_loss": round(last_logged_loss(log_history), 4),
        "training_precision": precision,
        "parameters": model.num_parameters(),
        "test_sentences": len(sources),
        "averaged_checkpoints": [checkpoint.name for checkpoint in averaging.checkpoints],
        "validation": validation_summary(log_history) if settings.eval_bleu_steps else None,
        "validation_loss": (validation_loss_summary(log_history) if settings.early_stopping_metric == "loss" else None),
        "settings": asdict(settings),
        # scores of a seeded run differ slightly between CPU models (kernels differ in the last bits): say which one
        "cpu": cpu_model_name(),
        "gpu": gpu_name(trainer.args.device),
        "command": run.command,
        # what the settings left to the preset and the paper, as the saved config and generation config hold it
        "label_smoothing": settings.label_smoothing,
        "num_beams": model.generation_config.num_beams,
        "length_penalty": model.generation_config.length_penalty,
        "length_penalty_type": model.generation_config.length_penalty_type,
        "examples": [
            {"source": s, "reference": r, "translation": h}
            for s, r, h in list(zip(sources, references, hypotheses, strict=True))[:5]
        ],
    }


def write_run_outputs(
    corpus: DatasetDict,
    run: RecipeRun,
    model: VaswaniForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    results: dict,
    log_history: list[dict],
) -> None:
    """The Hub-ready model folder (with its card, and the shortlist where the settings build one), results.json and
    the training curves, each whole or not at all."""
    settings, model_dir = run.settings, run.output_dir / "model"
    shortlist = None
    if settings.build_shortlist:
        train_pairs = corpus["train"]
        sizes = (len(tokenizer), SHORTLIST_PER_SOURCE, SHORTLIST_FREQUENT)
        shortlist = shortlist_of_corpus(tokenizer, list(train_pairs["source"]), list(train_pairs["target"]), *sizes)

    def write_model_folder(folder: Path) -> None:
        save_model_folder(model, tokenizer, folder)
        if shortlist is not None:
            shortlist.save(folder)
        example = corpus["test"]["source"][0]
        card_fields = (model.config, settings, results, run.source_lang, run.target_lang, run.dataset_name, example)
        write_model_card(folder, *card_fields, model_name=model_dir.name)
        copy_missing_entries(model_dir, folder)  # a resumed run's folder keeps what others put there

    replace_folder(model_dir, write_model_folder)
    write_text(run.output_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    plot_training_curves(log_history, run.output_dir / "training_curves.png")


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


def validation_loss_summary(log_history: list[dict]) -> dict:
    """The validation loss and cross-entropy per target token (nats) at every validation, and where it was lowest."""
    curve = [
        {
            "step": entry["step"],
            "epoch": round(entry["epoch"], 2),
            **{key: round(entry[key], 4) for key in VALIDATION_LOSS_KEYS},
        }
        for entry in log_history
        if all(key in entry for key in VALIDATION_LOSS_KEYS)
    ]
    best = best_validation_loss(log_history)
    return {
        "best_step": best["step"] if best else None,
        "best_loss": round(best["eval_loss"], 4) if best else None,
        "curve": curve,
    }


def last_logged_loss(log_history: list[dict]) -> float:
    """The training loss of the last logging interval (a resumed run has the log history from its checkpoint)."""
    return next(entry["loss"] for entry in reversed(log_history) if "loss" in entry)


def training_arguments(settings: RecipeSettings, output_dir: Path, precision: str) -> Seq2SeqTrainingArguments:
    """The Trainer's arguments of a run: the paper's (`paper_training_arguments`) with the settings', checkpoints in
    `output_dir`, training in `precision` ("bf16", "fp16" or "fp32")."""
    compiled = compiles(settings.torch_compile)
    return paper_training_arguments(
        output_dir,
        max_steps=settings.max_steps,
        warmup_steps=settings.warmup_steps,
        learning_rate=settings.learning_rate_scale,  # VaswaniTrainer multiplies Eq. 3 by it
        adam_epsilon=settings.adam_epsilon,
        max_grad_norm=settings.max_grad_norm or 0.0,  # 0: Trainer clips nothing
        label_smoothing_factor=settings.label_smoothing,
        gradient_accumulation_steps=settings.update_freq,
        save_strategy="epoch" if settings.save_every_epoch else "steps",
        save_steps=settings.save_steps,
        save_total_limit=checkpoints_to_keep(settings),
        logging_steps=settings.logging_steps,
        seed=settings.seed,
        data_seed=settings.seed,
        full_determinism=settings.full_determinism,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        torch_compile=compiled,
        torch_compile_mode=compile_mode(compiled, settings.update_freq),
        tf32=uses_tf32(),
        dataloader_num_workers=batch_loader_workers(),
    )


def check_epoch_checkpoints(settings: RecipeSettings, updates_per_epoch: int) -> None:
    """Refuse, in one ValueError line, a run with --save-every-epoch that would save fewer checkpoints than it averages:
    one at the end of each epoch, the last (maybe partial) one ending at max_steps."""
    epochs = math.ceil(settings.max_steps / updates_per_epoch)
    if epochs < settings.average_last:
        raise UsageError(
            f"averaging the last {settings.average_last} checkpoints ({setting_flag('average_last')}) with "
            f"{setting_flag('save_every_epoch')} needs {settings.average_last} epochs, but {setting_flag('max_steps')} "
            f"{settings.max_steps} at {updates_per_epoch} updates per epoch makes {epochs}"
        )


def checkpoints_to_keep(settings: RecipeSettings) -> int:
    """Checkpoints the run keeps on disk (Trainer's `save_total_limit`): those averaged, and with early stopping on
    validation BLEU also those saved after the best step until training stops (`patience` evaluations, each a
    checkpoint every `save_steps`, plus the one saved at the stop), so that the average can end at the best step.
    Early stopping on the validation loss averages the last checkpoints at the stop: those averaged are enough."""
    if settings.early_stopping_patience is None or settings.early_stopping_metric == "loss":
        return settings.average_last
    saves_per_evaluation = -(-settings.eval_bleu_steps // settings.save_steps)
    return settings.average_last + settings.early_stopping_patience * saves_per_evaluation + 1
