"""The training recipe: Eq. 3 against the formula, stock Seq2SeqTrainer fine-tuning, token batches, the whole recipe."""

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, DatasetDict
from tiny import (
    TINY_MODEL,
    TOY_SOURCES,
    TOY_TARGETS,
    TRAINABLE_MODEL,
    toy_corpus,
    toy_dataset,
    toy_settings,
    toy_tokenizer,
    toy_train_options,
    write_corpus_files,
)
from torch import nn
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    GenerationConfig,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    get_scheduler,
)

import hf_vaswani  # noqa: F401
from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.data.bpe_dropout import BpeDropoutPairs, resegmented_batch_sampler
from hf_vaswani.kernels.cpu_features import cpu_bf16_matmul_works
from hf_vaswani.model.generation_vaswani import paper_generation_config
from hf_vaswani.training import schedule
from hf_vaswani.training.precision import bf16_training_seconds
from hf_vaswani.training.recipe import build_model, run_recipe
from hf_vaswani.training.schedule import TrainingTimeBudgetCallback, paper_learning_rate, paper_lr_scheduler
from hf_vaswani.training.settings import DEMO_SETTINGS, RecipeSettings, model_config
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments, tokenize_corpus


def eq3(step: int, d_model: int, warmup: int) -> float:
    """Written from the paper, independently of the library: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    return d_model**-0.5 * min(1 / math.sqrt(step), step / warmup**1.5)


def test_schedule_is_equation_3_from_the_first_update() -> None:
    d_model, warmup = 512, 40
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = paper_lr_scheduler(optimizer, d_model, warmup)
    for step in range(1, 200):
        # the learning rate used by update number `step` (1-based, as in the paper)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(eq3(step, d_model, warmup), rel=1e-12)
        assert paper_learning_rate(step, d_model, warmup) == pytest.approx(eq3(step, d_model, warmup), rel=1e-12)
        optimizer.step()
        scheduler.step()
    assert max(eq3(s, d_model, warmup) for s in range(1, 200)) == pytest.approx(eq3(warmup, d_model, warmup))


def test_cooldown_multiplies_equation_3_by_a_linear_fall_to_zero() -> None:
    d_model, warmup, total, cooldown = 512, 40, 200, 50
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = paper_lr_scheduler(optimizer, d_model, warmup, cooldown_steps=cooldown, total_steps=total)
    for step in range(1, total + 2):
        steps_left = total - step + 1  # this update included: the last one gets 1/cooldown of Eq. 3, later ones 0
        expected = eq3(step, d_model, warmup) * min(1.0, steps_left / cooldown)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=0.0)
        optimizer.step()
        scheduler.step()
    with pytest.raises(ValueError, match="cooldown_steps must be in 1..total_steps"):
        paper_lr_scheduler(optimizer, d_model, warmup, cooldown_steps=total + 1, total_steps=total)


def test_transformers_inverse_sqrt_lags_equation_3_by_one_update() -> None:
    """Why Eq. 3 is written out: HF's schedule with lr (d_model * warmup)^-0.5 is the same curve, one step late."""
    d_model, warmup = 512, 40
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=(d_model * warmup) ** -0.5)
    scheduler = get_scheduler("inverse_sqrt", optimizer, num_warmup_steps=warmup)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the first update would not move the weights
    for step in range(2, 200):
        optimizer.step()
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(eq3(step - 1, d_model, warmup), rel=1e-9)


def test_paper_training_arguments_are_section_5_3_and_5_4() -> None:
    args = paper_training_arguments("unused")
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (0.9, 0.98, 1e-9, 0.0)
    assert args.warmup_steps == 4000
    assert args.label_smoothing_factor == 0.1


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.fixture
def saved_model(tmp_path, tokenizer):
    """A model saved with its tokenizer, as a user would fine-tune it."""
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL))
    model.generation_config.max_new_tokens = 12
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_stock_seq2seq_trainer_fine_tunes_with_predict_with_generate(tmp_path, saved_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    model = AutoModelForSeq2SeqLM.from_pretrained(saved_model)
    tokenized = tokenize_corpus(toy_dataset(), tokenizer)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=30,
        learning_rate=3e-3,
        predict_with_generate=True,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=10,
    )
    decoded: list[list[str]] = []

    def compute_metrics(prediction) -> dict:
        ids = prediction.predictions
        ids = ids.clip(min=0)  # generated sequences are padded with -100 by the Trainer across batches
        decoded.append(tokenizer.batch_decode(ids, skip_special_tokens=True))
        return {"generated": len(decoded[-1])}

    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        eval_dataset=tokenized,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] < before - 0.5, (before, metrics)
    assert metrics["eval_generated"] == len(TOY_SOURCES)
    assert all(isinstance(text, str) for text in decoded[-1])


def test_vaswani_trainer_uses_token_batches_and_equation_3_with_its_cooldown(tmp_path, saved_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    model = AutoModelForSeq2SeqLM.from_pretrained(saved_model)
    data = toy_dataset(4)
    tokenized = tokenize_corpus(data, tokenizer).add_column("pair", list(range(len(data))))  # forward takes no pair
    args = paper_training_arguments(
        tmp_path / "out",
        max_steps=12,
        warmup_steps=5,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        max_tokens=40,
        cooldown_steps=4,
    )
    loader = trainer.get_train_dataloader()
    for batch in loader:
        assert batch["input_ids"].numel() <= 40 and batch["labels"].numel() <= 40 and "pair" not in batch
    trainer.train()
    rates = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    expected = [eq3(step, model.config.d_model, 5) * min(1.0, (12 - step + 1) / 4) for step in range(1, 13)]
    assert rates == pytest.approx(expected, rel=1e-6)  # Eq. 3, then the last 4 updates at 4/4, 3/4, 2/4, 1/4 of it


@pytest.mark.parametrize("label_smoothing_factor", [0.1, 0.0])
def test_vaswani_trainer_smooths_the_training_loss_and_logs_the_cross_entropy_beside_it(
    tmp_path, tokenizer, label_smoothing_factor: float
) -> None:
    """The weights held still (learning rate 0), each optimizer step sees the whole toy corpus under the same model:
    8 pairs, 2 batches of 4 accumulated. Each logged `loss` is then torch's label-smoothed cross-entropy over all its
    target tokens, and `nll_loss` the plain cross-entropy, however the tokens fall into the two batches; evaluation
    reports the cross-entropy."""
    torch.manual_seed(0)
    config = VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL, dropout=0.0)  # train mode = eval mode
    model = VaswaniForConditionalGeneration(config)
    tokenized = tokenize_corpus(toy_dataset(), tokenizer)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    args = paper_training_arguments(
        tmp_path,
        learning_rate=0.0,
        label_smoothing_factor=label_smoothing_factor,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=8,
        max_steps=4,
        logging_steps=2,
        warmup_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = VaswaniTrainer(
        model=model, args=args, train_dataset=tokenized, eval_dataset=tokenized, data_collator=collator
    )
    trainer.train()
    batch = collator([tokenized[i] for i in range(len(tokenized))])
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
        ).logits
    logits, labels = logits.flatten(0, 1), batch["labels"].flatten()  # -100 where padded
    cross_entropy = nn.functional.cross_entropy(logits, labels).item()
    smoothed = nn.functional.cross_entropy(logits, labels, label_smoothing=label_smoothing_factor).item()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [2, 4]
    for entry in logged:
        assert entry["loss"] == pytest.approx(smoothed, rel=1e-5)
        assert entry["nll_loss"] == pytest.approx(cross_entropy, rel=1e-5)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(cross_entropy, rel=1e-5)  # its exp: the perplexity
    assert model.config.label_smoothing == 0.0  # the trained model's own loss stays the cross-entropy


def test_bpe_dropout_segments_every_epoch_afresh_into_the_exact_text(tokenizer) -> None:
    sources, targets = TOY_SOURCES * 4, TOY_TARGETS * 4
    deterministic = tokenizer(sources, text_target=targets)
    pairs = BpeDropoutPairs(sources, targets, tokenizer, dropout=0.5)
    epochs = []
    for epoch in (0, 1, 1):
        pairs.set_epoch(epoch)
        items = [pairs[index] for index in range(len(pairs))]
        for item, source, target in zip(items, sources, targets, strict=True):
            assert item["input_ids"][-1] == item["labels"][-1] == tokenizer.eos_token_id
            assert tokenizer.decode(item["input_ids"], skip_special_tokens=True) == source
            assert tokenizer.decode(item["labels"], skip_special_tokens=True) == target
            assert item["attention_mask"] == [1] * len(item["input_ids"])
        assert pairs.lengths() == ([len(i["input_ids"]) for i in items], [len(i["labels"]) for i in items])
        epochs.append(items)
    assert epochs[1] != epochs[0] and epochs[2] == epochs[1]  # a new epoch draws anew, the same epoch is kept
    # Skipped merges leave more, shorter pieces; the tokenizer itself stays deterministic for validation and test.
    assert sum(len(item["labels"]) for item in epochs[0]) > sum(map(len, deterministic["labels"]))
    assert tokenizer(sources, text_target=targets) == deterministic
    with pytest.raises(ValueError, match=r"BPE-dropout must be in \(0, 1\), got 1"):
        BpeDropoutPairs(sources, targets, tokenizer, dropout=1)


def test_bpe_dropout_batches_fit_each_epochs_segmentation_in_a_constant_count(tokenizer) -> None:
    sources, targets = TOY_SOURCES * 8, TOY_TARGETS * 8
    pairs = BpeDropoutPairs(sources, targets, tokenizer, dropout=0.3)
    sampler = resegmented_batch_sampler(pairs, max_tokens=60, seed=0)
    first_epoch_lengths = pairs.lengths()
    for epoch in range(4):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        source_lengths, target_lengths = pairs.lengths()  # this epoch's, read back from the items served
        assert source_lengths == [len(pairs[index]["input_ids"]) for index in range(len(pairs))]
        assert len(batches) == len(sampler) == sampler.batches_per_epoch  # what Trainer counted from the first epoch
        assert sorted(index for batch in batches for index in batch) == list(range(len(pairs)))
        for batch in batches:
            assert len(batch) * max(source_lengths[index] for index in batch) <= 60
            assert len(batch) * max(target_lengths[index] for index in batch) <= 60
    assert pairs.lengths() != first_epoch_lengths


def test_vaswani_trainer_trains_on_bpe_dropout_pairs(tmp_path, saved_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    model = AutoModelForSeq2SeqLM.from_pretrained(saved_model)
    pairs = BpeDropoutPairs(TOY_SOURCES * 4, TOY_TARGETS * 4, tokenizer, dropout=0.1)
    args = paper_training_arguments(
        tmp_path / "out", max_steps=30, warmup_steps=5, save_strategy="no", use_cpu=True, disable_tqdm=True
    )
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    trainer = VaswaniTrainer(model=model, args=args, train_dataset=pairs, data_collator=collator, max_tokens=40)
    for batch in trainer.get_train_dataloader():
        assert batch["input_ids"].numel() <= 40 and batch["labels"].numel() <= 40
    trainer.train()
    assert trainer.state.global_step == 30 and pairs.epoch >= 1  # more than one epoch, each segmented afresh


def test_bpe_dropout_with_several_processes_is_refused_before_any_work(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    corpus = DatasetDict(
        {split: Dataset.from_dict({"source": ["a ."], "target": ["b ."]}) for split in ("train", "test")}
    )
    with pytest.raises(ValueError, match="--bpe-dropout segments in one process"):
        run_recipe(corpus, tmp_path / "run", RecipeSettings(bpe_dropout=0.1))
    assert not (tmp_path / "run").exists()


def budgeted_trainer(tmp_path, saved_model, monkeypatch, step_seconds, minutes, **trainer_kwargs) -> VaswaniTrainer:
    """A VaswaniTrainer with a time budget of `minutes` on a clock whose optimizer steps take `step_seconds` each."""
    ends = itertools.accumulate(step_seconds, initial=0.0)  # the clock at train begin, then at each step's end
    monkeypatch.setattr(schedule, "time", SimpleNamespace(perf_counter=lambda: next(ends)))
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    model = AutoModelForSeq2SeqLM.from_pretrained(saved_model)
    data = toy_dataset(4)
    args = paper_training_arguments(
        tmp_path / "out", max_steps=100, warmup_steps=5, save_steps=50, use_cpu=True, disable_tqdm=True, logging_steps=1
    )
    return VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenize_corpus(data, tokenizer),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        max_tokens=40,
        callbacks=[TrainingTimeBudgetCallback(minutes)],
        **trainer_kwargs,
    )


def test_time_budget_ends_the_run_where_its_cooldown_ends(tmp_path, saved_model, monkeypatch) -> None:
    # Steps of 1 s and a 12 s budget: the 12-step run of the cooldown test above, learning rates and all.
    trainer = budgeted_trainer(tmp_path, saved_model, monkeypatch, [1.0] * 100, minutes=0.2, cooldown_steps=4)
    trainer.train()
    assert trainer.state.global_step == 12
    rates = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    expected = [eq3(step, trainer.model.config.d_model, 5) * min(1.0, (12 - step + 1) / 4) for step in range(1, 13)]
    assert rates == pytest.approx(expected, rel=1e-6)
    # A resumed run ends at the step the saved schedule holds, whatever max_steps the new trainer starts from.
    resumed = paper_lr_scheduler(trainer.optimizer, trainer.model.config.d_model, 5, cooldown_steps=4, total_steps=100)
    resumed.load_state_dict(trainer.lr_scheduler.state_dict())
    assert resumed.lr_lambdas[0].total_steps == 12


def test_time_budget_ends_a_slowed_cooldown_sooner_with_the_rate_falling_from_where_it_was(
    tmp_path, saved_model, monkeypatch
) -> None:
    # 19 steps of 1 s, then of 2 s, a 30 s budget and an 8-step cooldown. The cooldown begins at step 21 with the end
    # projected at step 28 (30 s * 20 steps / 21 s), which the slower steps would reach at 37 s.
    step_seconds = [1.0] * 19 + [2.0] * 81
    trainer = budgeted_trainer(tmp_path, saved_model, monkeypatch, step_seconds, minutes=0.5, cooldown_steps=8)
    trainer.train()
    steps = trainer.state.global_step
    assert sum(step_seconds[:steps]) <= 30 + 2  # within the budget but for the step that crosses it
    d_model = trainer.model.config.d_model
    factors = [
        entry["learning_rate"] / eq3(entry["step"], d_model, 5)
        for entry in trainer.state.log_history
        if "learning_rate" in entry
    ]
    assert factors[:20] == pytest.approx([1.0] * 20)  # Eq. 3 itself until the cooldown
    assert all(later < earlier for earlier, later in itertools.pairwise(factors[20:]))  # then falling, never rising
    # The last update gets 1 / cooldown_steps of Eq. 3, as in a planned cooldown, with the shortened cooldown's length.
    assert factors[-1] == pytest.approx(1 / trainer.lr_scheduler.lr_lambdas[0].cooldown_steps)
    assert trainer.lr_scheduler.lr_lambdas[0].total_steps == steps


def test_time_budget_without_a_cooldown_stops_and_saves_when_time_is_up(tmp_path, saved_model, monkeypatch) -> None:
    # 6 steps of 1 s, then of 3 s: the clock reaches the 30 s budget at the end of step 6 + (30 - 6) / 3 = 14.
    trainer = budgeted_trainer(tmp_path, saved_model, monkeypatch, [1.0] * 6 + [3.0] * 94, minutes=0.5)
    trainer.train()
    assert trainer.state.global_step == 14
    assert (tmp_path / "out" / "checkpoint-14").is_dir()
    with pytest.raises(ValueError, match="--max-train-minutes must be positive"):
        RecipeSettings(max_train_minutes=0)


def test_time_budget_is_spent_when_the_first_step_is_slow(tmp_path, saved_model, monkeypatch) -> None:
    # Step 1 costs 61 s (compilation, kernel timing, the first batch), the others 1 s: a 2-minute budget has room for
    # 60 steps. A rate counted from step 1 would project 2, and with the cooldown beginning at once end at step 11.
    step_seconds, cooldown = [61.0] + [1.0] * 99, 10
    trainer = budgeted_trainer(tmp_path, saved_model, monkeypatch, step_seconds, minutes=2, cooldown_steps=cooldown)
    trainer.train()
    steps = trainer.state.global_step
    assert 0.9 * 120 <= sum(step_seconds[:steps]) <= 120 + 1
    d_model = trainer.model.config.d_model
    factors = [
        entry["learning_rate"] / eq3(entry["step"], d_model, 5)
        for entry in trainer.state.log_history
        if "learning_rate" in entry
    ]
    # Eq. 3 until the cooldown's planned length before the end, then down to 1 / cooldown_steps at the last step
    assert factors[: steps - cooldown] == pytest.approx([1.0] * (steps - cooldown))
    assert factors[-cooldown:] == pytest.approx([(cooldown - i) / cooldown for i in range(cooldown)])
    assert trainer.lr_scheduler.lr_lambdas[0].total_steps == steps


def test_a_run_shorter_than_its_logging_interval_writes_its_results(tmp_path, monkeypatch) -> None:
    # A clock on which each reading is 1 s later: a 6 s budget ends the run within a few steps, before step 50's log.
    monkeypatch.setattr(schedule, "time", SimpleNamespace(perf_counter=itertools.count().__next__))
    options = toy_train_options(max_steps=100, save_steps=10, average_last=1, logging_steps=50, max_train_minutes=0.1)
    main(["train", "--output-dir", str(tmp_path / "run"), *write_corpus_files(tmp_path), *options])  # exits 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert 1 <= results["steps"] < 50 and math.isfinite(results["final_training_loss"])
    assert (tmp_path / "run" / "training_curves.png").is_file()


@pytest.mark.parametrize(
    ("logging_steps", "seen"),
    [(2, "training diverged at step 6: the training loss logged there is nan"), (4, "at step 6: the training cross")],
)
def test_a_diverged_run_stops_at_its_next_log_or_checkpoint_keeping_those_before(
    logging_steps, seen, tmp_path, monkeypatch, capfd
) -> None:
    # The weights blow up in step 5. With a log every 2 steps, step 6's log sees it; with one every 4 steps, the
    # checkpoint of step 6 comes first, and is not saved.
    original = VaswaniTrainer.compute_loss

    def diverging(self, model, inputs, *args, **kwargs):
        if model.training and self.state.global_step == 4:
            with torch.no_grad():
                model.get_input_embeddings().weight.fill_(math.inf)
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(VaswaniTrainer, "compute_loss", diverging)
    options = toy_train_options(max_steps=12, save_steps=2, average_last=2, logging_steps=logging_steps)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--output-dir", str(run), *write_corpus_files(tmp_path), *options])
    assert stopped.value.code == 2
    error = capfd.readouterr().err
    error = error[error.index("vaswani train: error: ") :]  # after the progress bar
    assert seen in error and error.count("\n") == 1, error
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        weights = AutoModelForSeq2SeqLM.from_pretrained(run / "checkpoints" / checkpoint).parameters()
        assert all(weight.isfinite().all() for weight in weights)
    assert not (run / "model").exists() and not (run / "results.json").exists()


def test_whole_recipe_writes_a_loadable_scored_model_folder(tmp_path) -> None:
    settings = toy_settings(warmup_steps=10, max_steps=20, save_steps=4, average_last=3, bpe_dropout=0.1)
    results = run_recipe(toy_corpus(), tmp_path, settings, dataset_name="toy")
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["steps"] == 20 and 0 <= written["bleu"] <= 100 and "chrf" in written
    assert (tmp_path / "training_curves.png").stat().st_size > 10_000
    card = (tmp_path / "model" / "README.md").read_text()
    # the scores name the CPU that produced them (lscpu's "Model name" is /proc/cpuinfo's "model name")
    cpu_lines = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    if cpu_lines:
        assert results["cpu"] == cpu_lines[0].partition(":")[2].strip() and results["cpu"] in card
    assert results["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert card.startswith("---\n") and f"value: {results['bleu']}" in card and "$" not in card.split("---")[1]
    assert "| BPE-dropout in training | none | 0.1 |" in card
    assert "| dropout P_drop / label smoothing | 0.1 / 0.1 | 0.1 / 0.1 |" in card  # §5.4's, a training setting
    # the logs beside the smoothed loss: the cross-entropy, its exp the training perplexity
    last_state = json.loads((tmp_path / "checkpoints" / "checkpoint-20" / "trainer_state.json").read_text())
    logged = [entry for entry in last_state["log_history"] if "loss" in entry]
    assert logged and all(0 < entry["nll_loss"] < math.inf for entry in logged)
    assert "BPE-dropout in training" in card.partition("Deviations from the paper:")[2].splitlines()[0]
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "model")
    assert model.config.label_smoothing == 0.0  # what users load returns the cross-entropy
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    # The saved weights are the average of the last 3 checkpoints, not the last one.
    checkpoints = sorted((tmp_path / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    states = [VaswaniForConditionalGeneration.from_pretrained(p).state_dict() for p in checkpoints[-3:]]
    expected = torch.stack([s["lm_head.weight"] for s in states]).mean(0)
    torch.testing.assert_close(model.state_dict()["lm_head.weight"], expected)
    out = model.generate(**tokenizer(["the dog sleeps ."], return_tensors="pt"), max_new_tokens=8)
    assert isinstance(tokenizer.decode(out[0], skip_special_tokens=True), str)


def test_label_smoothing_is_a_training_setting_the_papers_by_default() -> None:
    assert RecipeSettings().label_smoothing == DEMO_SETTINGS.label_smoothing == 0.1  # §5.4
    assert model_config(RecipeSettings()).label_smoothing == 0.0  # the saved model returns the cross-entropy
    with pytest.raises(ValueError, match="--model-override label_smoothing: a training setting.*--label-smoothing"):
        RecipeSettings(model_overrides={"label_smoothing": 0.2})
    with pytest.raises(ValueError, match=r"--label-smoothing must be in \[0, 1\), got 1.0"):
        RecipeSettings(label_smoothing=1.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(save_every_epoch=True, save_steps=50), "--save-steps has no effect with --save-every-epoch"),
        (dict(eval_bleu_sample=100), "--eval-bleu-sample has no effect without --eval-bleu-steps"),
        (dict(eval_bleu_num_beams=4), "--eval-bleu-num-beams has no effect without --eval-bleu-steps"),
        (dict(num_beams=1, length_penalty=1.4), "--length-penalty has no effect with --num-beams 1 .greedy"),
        (dict(num_beams=1, length_penalty_type="power"), "--length-penalty-type has no effect with --num-beams 1"),
    ],
)
def test_settings_of_which_one_would_be_ignored_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecipeSettings(**changes)


def test_settings_refuse_what_could_not_finish() -> None:
    with pytest.raises(ValueError, match=r"--logging-steps \(100\) is larger than --max-steps \(4\)"):
        RecipeSettings(max_steps=4, save_steps=1, average_last=1)
    with pytest.raises(ValueError, match="exclude each other"):
        RecipeSettings(bf16=True, fp16=True)
    with pytest.raises(ValueError, match=r"--cooldown-steps \(9\) is larger than --max-steps \(8\)"):
        RecipeSettings(max_steps=8, cooldown_steps=9, save_steps=1, logging_steps=1)
    with pytest.raises(ValueError, match="--num-beams must be an integer of at least 1, got 0"):
        RecipeSettings(num_beams=0)
    with pytest.raises(ValueError, match=r"--bpe-dropout must be in \(0, 1\), got 1.5"):
        RecipeSettings(bpe_dropout=1.5)
    with pytest.raises(ValueError, match="--bpe-dropout draws from tokenizers' unseeded generator"):
        RecipeSettings(bpe_dropout=0.1, full_determinism=True)
    with pytest.raises(ValueError, match="^VaswaniConfig refuses the settings: .*field 'dropout'[^\n]*$"):
        RecipeSettings(model_overrides={"dropout": "high"})  # strict's type error, as one ValueError line
    assert DEMO_SETTINGS.max_steps >= DEMO_SETTINGS.logging_steps  # the demo is a preset of the same settings


def test_build_model_puts_only_the_given_decoding_on_the_papers(tokenizer) -> None:
    model = build_model(toy_settings(), tokenizer)
    assert model.config.vocab_size == len(tokenizer) and model.config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.to_dict() == paper_generation_config(model.config, num_beams=2).to_dict()
    default = build_model(toy_settings(num_beams=None), tokenizer)
    assert default.generation_config.to_dict() == paper_generation_config(default.config).to_dict()


def test_a_greedy_models_generation_config_passes_transformers_checks_and_saves(tokenizer, tmp_path) -> None:
    # transformers refuses to save a config with num_beams 1 beside beam-only settings (the paper's alpha and early
    # termination): a run with --num-beams 1 would fail at its first checkpoint
    model = build_model(toy_settings(num_beams=1), tokenizer)
    model.generation_config.validate(strict=True)
    model.generation_config.save_pretrained(tmp_path)
    saved = GenerationConfig.from_pretrained(tmp_path)
    assert (saved.num_beams, saved.max_new_tokens_over_source, saved.eos_token_id) == (1, 50, tokenizer.eos_token_id)


def test_bf16_on_a_cpu_whose_bf16_matmul_traps_is_a_clear_error(tmp_path, monkeypatch) -> None:
    import hf_vaswani.training.trainer as trainer

    monkeypatch.setattr(trainer, "cpu_bf16_matmul_works", lambda: False)
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"):
        trainer.paper_training_arguments(tmp_path, bf16=True, use_cpu=True)
    assert not trainer.paper_training_arguments(tmp_path, use_cpu=True).bf16  # fp32 is not probed


def test_bf16_if_faster_takes_bf16_only_for_a_measured_clear_win(monkeypatch, capsys) -> None:
    import hf_vaswani.training.precision as precision

    settings = toy_settings(bf16_if_faster=True)
    monkeypatch.setattr(precision, "cpu_bf16_matmul_works", lambda: True)
    for seconds, expected in [({"fp32": 0.5, "bf16": 0.4}, "bf16"), ({"fp32": 0.5, "bf16": 0.47}, "fp32")]:
        monkeypatch.setattr(precision, "bf16_training_seconds", lambda config, max_tokens, seconds=seconds: seconds)
        assert precision.training_precision(settings) == expected
        assert capsys.readouterr().err.startswith(f"--bf16-if-faster: {expected} (a training step")
    monkeypatch.setattr(precision, "cpu_bf16_matmul_works", lambda: False)
    assert precision.training_precision(settings) == "fp32"
    assert "traps" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--bf16-if-faster measures in one process"):
        precision.training_precision(settings)
    assert precision.training_precision(RecipeSettings(bf16=True)) == "bf16"
    assert precision.training_precision(RecipeSettings()) == "fp32"
    with pytest.raises(ValueError, match="--bf16 and --bf16-if-faster exclude each other"):
        RecipeSettings(bf16=True, bf16_if_faster=True)
    with pytest.raises(ValueError, match="--bf16-if-faster chooses the precision by timing"):
        RecipeSettings(bf16_if_faster=True, full_determinism=True)


@pytest.mark.skipif(not cpu_bf16_matmul_works(), reason="a bfloat16 matmul traps on this CPU")
def test_bf16_training_seconds_times_both_precisions_of_the_configured_model() -> None:
    seconds = bf16_training_seconds(VaswaniConfig(**TINY_MODEL), max_tokens=96, rounds=1)
    assert set(seconds) == {"fp32", "bf16"} and all(0 < value < 60 for value in seconds.values())
