"""Validation BLEU during training: logged at the right steps, equal to sacrebleu on the model's own greedy output,
early stopping, and the recipe's wiring (results.json and the training-curve plot)."""

import json

import pytest
import sacrebleu
import torch
from datasets import DatasetDict
from PIL import Image
from tiny import TOY_SOURCES, TOY_TARGETS, TRAINABLE_MODEL, toy_corpus, toy_dataset, toy_settings, toy_tokenizer
from transformers import DataCollatorForSeq2Seq, TrainerControl, TrainerState

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.decoding.translation import translate
from hf_vaswani.plots import plot_training_curves
from hf_vaswani.training.callbacks import ValidationBleuCallback
from hf_vaswani.training.recipe import checkpoints_to_keep, run_recipe
from hf_vaswani.training.settings import RecipeSettings
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments, tokenize_corpus


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def tiny_trainer(
    tokenizer, tmp_path, max_steps: int, learning_rate: float = 1.0, save_steps: int | None = None
) -> VaswaniTrainer:
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=len(tokenizer),
        **TRAINABLE_MODEL,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = VaswaniForConditionalGeneration(config)
    model.generation_config.max_new_tokens = 10
    train = tokenize_corpus(toy_dataset(4), tokenizer)
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}
    args = paper_training_arguments(
        tmp_path, max_steps=max_steps, warmup_steps=4, learning_rate=learning_rate, logging_steps=1, **saving
    )
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    return VaswaniTrainer(
        model=model, args=args, train_dataset=train, data_collator=collator, processing_class=tokenizer, max_tokens=64
    )


def validation_entries(trainer: VaswaniTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "eval_bleu" in entry]


def test_validation_bleu_is_logged_every_n_steps_and_is_sacrebleu_of_the_greedy_output(tokenizer, tmp_path) -> None:
    trainer = tiny_trainer(tokenizer, tmp_path, max_steps=9)
    callback = ValidationBleuCallback(tokenizer, TOY_SOURCES, TOY_TARGETS, "de", eval_steps=3, log=trainer.log)
    trainer.add_callback(callback)
    trainer.train()
    entries = validation_entries(trainer)
    assert [entry["step"] for entry in entries] == [3, 6, 9]
    assert all(entry["elapsed_minutes"] > 0 for entry in entries)
    # Step 9 is the last: the final weights are the ones the last evaluation translated with.
    hypotheses = translate(trainer.model, tokenizer, TOY_SOURCES, progress=False, num_beams=1)
    expected = sacrebleu.corpus_bleu(hypotheses, [TOY_TARGETS]).score
    assert entries[-1]["eval_bleu"] == pytest.approx(expected, abs=1e-9)
    best = max(entries, key=lambda entry: entry["eval_bleu"])  # the first of equal scores, as the callback keeps it
    assert (callback.best_step, callback.best_bleu) == (best["step"], best["eval_bleu"])


def test_validation_leaves_the_model_training(tokenizer, tmp_path) -> None:
    trainer = tiny_trainer(tokenizer, tmp_path, max_steps=1)
    logged = []
    callback = ValidationBleuCallback(
        tokenizer, TOY_SOURCES[:2], TOY_TARGETS[:2], "de", eval_steps=1, log=logged.append
    )
    trainer.model.train()
    callback.on_step_end(trainer.args, TrainerState(global_step=1), TrainerControl(), model=trainer.model)
    assert trainer.model.training  # dropout back on for the next step
    assert len(logged) == 1 and set(logged[0]) == {"eval_bleu", "eval_lowercased_tokenized_bleu", "elapsed_minutes"}


def test_early_stopping_stops_when_bleu_stops_improving(tokenizer, tmp_path) -> None:
    # A learning rate of 0 keeps the weights, so BLEU never improves after the first evaluation.
    trainer = tiny_trainer(tokenizer, tmp_path, max_steps=20, learning_rate=0.0)
    callback = ValidationBleuCallback(
        tokenizer, TOY_SOURCES, TOY_TARGETS, "de", eval_steps=2, log=trainer.log, early_stopping_patience=2
    )
    trainer.add_callback(callback)
    trainer.train()
    assert trainer.state.global_step == 6  # evaluations at 2 (best), 4 and 6 (two without improvement)
    assert [entry["step"] for entry in validation_entries(trainer)] == [2, 4, 6]
    assert callback.best_step == 2


def test_early_stopping_saves_the_best_step_and_the_last(tokenizer, tmp_path) -> None:
    # Checkpoints every 100 steps would give none in 6 steps: those saved are the best (2) and the stop (6).
    trainer = tiny_trainer(tokenizer, tmp_path, max_steps=20, learning_rate=0.0, save_steps=100)
    callback = ValidationBleuCallback(
        tokenizer, TOY_SOURCES, TOY_TARGETS, "de", eval_steps=2, log=trainer.log, early_stopping_patience=2
    )
    trainer.add_callback(callback)
    trainer.train()
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-6"]


def test_a_resumed_run_keeps_its_best_and_its_patience(tokenizer, tmp_path) -> None:
    # Learning rate 0: BLEU never improves after step 2. Interrupted at step 4 (one evaluation without improvement),
    # the resumed run stops after two more (6, 8) for a patience of 3, as an uninterrupted one would.
    first = tiny_trainer(tokenizer, tmp_path, max_steps=4, learning_rate=0.0, save_steps=4)
    first.add_callback(
        ValidationBleuCallback(tokenizer, TOY_SOURCES, TOY_TARGETS, "de", 2, log=first.log, early_stopping_patience=3)
    )
    first.train()
    resumed = tiny_trainer(tokenizer, tmp_path, max_steps=20, learning_rate=0.0, save_steps=100)
    callback = ValidationBleuCallback(
        tokenizer, TOY_SOURCES, TOY_TARGETS, "de", 2, log=resumed.log, early_stopping_patience=3
    )
    resumed.add_callback(callback)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    entries = validation_entries(resumed)
    assert [entry["step"] for entry in entries] == [2, 4, 6, 8] and resumed.state.global_step == 8
    assert callback.best_step == 2
    minutes = [entry["elapsed_minutes"] for entry in entries]
    assert minutes == sorted(minutes)  # the curve's clock goes on from the interrupted run's


@pytest.mark.parametrize(
    ("patience", "eval_bleu_steps", "save_steps", "kept"),
    # average 5; after the best: patience x ceil(eval / save) checkpoints, and the one saved at the stop
    [(None, 100, 50, 5), (2, 100, 50, 5 + 2 * 2 + 1), (3, 100, 40, 5 + 3 * 3 + 1), (1, 30, 100, 5 + 1 + 1)],
)
def test_checkpoints_kept_cover_the_average_up_to_the_best(patience, eval_bleu_steps, save_steps, kept) -> None:
    settings = RecipeSettings(
        average_last=5,
        save_steps=save_steps,
        max_steps=1000,
        eval_bleu_steps=eval_bleu_steps,
        early_stopping_patience=patience,
    )
    assert checkpoints_to_keep(settings) == kept


def test_early_stopping_needs_validation() -> None:
    with pytest.raises(ValueError, match="--early-stopping-patience needs validation BLEU: set --eval-bleu-steps"):
        RecipeSettings(early_stopping_patience=3)


def test_recipe_validates_records_the_best_step_and_plots_bleu(tmp_path) -> None:
    corpus = toy_corpus(validation=True)
    settings = toy_settings(
        warmup_steps=10, max_steps=12, save_steps=4, average_last=3, eval_bleu_steps=4, eval_bleu_sample=5
    )
    results = run_recipe(corpus, tmp_path, settings, dataset_name="toy")
    assert json.loads((tmp_path / "results.json").read_text())["validation"] == results["validation"]
    curve = results["validation"]["curve"]
    assert [point["step"] for point in curve] == [4, 8, 12]
    best = max(curve, key=lambda point: point["eval_bleu"])
    assert (results["validation"]["best_step"], results["validation"]["best_bleu"]) == (best["step"], best["eval_bleu"])
    with Image.open(tmp_path / "training_curves.png") as figure:
        assert figure.size[0] > 1500  # three panels: loss, learning rate, validation BLEU
    assert "lowercased_tokenized_bleu" in results and results["lowercased_tokenized_bleu_signature"].startswith(
        "moses-tok:de|nrefs:1|case:lc|eff:no|tok:none|smooth:none"
    )
    with pytest.raises(ValueError, match="no 'validation' split"):
        run_recipe(DatasetDict({k: corpus[k] for k in ("train", "test")}), tmp_path / "other", settings)


def test_training_curves_add_a_validation_bleu_panel(tmp_path) -> None:
    history = [{"step": 10, "loss": 5.0, "learning_rate": 1e-3}, {"step": 20, "loss": 4.0, "learning_rate": 2e-3}]
    validation = [
        {"step": 10, "eval_bleu": 1.0, "eval_lowercased_tokenized_bleu": 1.5, "elapsed_minutes": 0.5},
        {"step": 20, "eval_bleu": 3.0, "eval_lowercased_tokenized_bleu": 3.5, "elapsed_minutes": 1.0},
    ]
    without = plot_training_curves(history, tmp_path / "without.png")
    with_bleu = plot_training_curves(history + validation, tmp_path / "with.png")
    assert Image.open(with_bleu).size[0] > Image.open(without).size[0]  # a third panel
