"""Trainer callbacks of the recipe: the checkpoint average at the end of training (§6.1), validation BLEU and the
validation loss."""

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..data.batching import TokenBatchSampler
from ..decoding.metrics import corpus_scores, lowercased_tokenized_bleu
from ..decoding.translation import translate
from ..files import replace_folder
from ..model.errors_vaswani import UsageError
from ..sharded_weights import has_sharded_weights
from .averaging import average_checkpoints, last_checkpoints

logger = logging.getLogger(__name__)


class CheckpointAveragingCallback(TrainerCallback):
    """§6.1: at the end of training, average the last `num_checkpoints` saved checkpoints into `output_dir/averaged`.

    With `end_at_best_validation`, the average ends at the step of the best validation BLEU that
    `ValidationBleuCallback` logged (early stopping trains on past it) instead of at the last checkpoint. Keep
    `save_total_limit` (if set) large enough for the checkpoints averaged, or they are gone before the average.

    A checkpoint of weights sharded by FSDP gets the model's config, generation config and tokenizer beside them as it
    is saved: Trainer writes those only beside whole weights, and the average of such checkpoints is a model folder.
    """

    def __init__(
        self, num_checkpoints: int = 5, subdirectory: str = "averaged", end_at_best_validation: bool = False
    ) -> None:
        self.num_checkpoints = num_checkpoints
        self.subdirectory = subdirectory
        self.end_at_best_validation = end_at_best_validation
        self.averaged_path: Path | None = None
        self.checkpoints: list[Path] = []  # those averaged, oldest first

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs) -> None:
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and has_sharded_weights(checkpoint):
            if processing_class is not None:
                processing_class.save_pretrained(checkpoint)
            # FSDP1's wrapper hands on the model's attributes too. config.json last: a checkpoint is complete with it
            # (checkpoints.checkpoint_problem).
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(checkpoint)
            model.config.save_pretrained(checkpoint)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            best = best_validation(state.log_history) if self.end_at_best_validation else None
            last_step = best["step"] if best else None
            self.checkpoints = last_checkpoints(args.output_dir, self.num_checkpoints, up_to_step=last_step)
            self.averaged_path = replace_folder(
                Path(args.output_dir) / self.subdirectory, lambda folder: average_checkpoints(self.checkpoints, folder)
            )


def best_validation(log_history: list[dict]) -> dict | None:
    """The entry `ValidationBleuCallback` logged with the highest validation sacreBLEU (the first of equal ones).

    Read from the log history, which a resumed run restores from its checkpoint, so it covers the whole run.
    """
    return max((entry for entry in log_history if "eval_bleu" in entry), key=lambda e: e["eval_bleu"], default=None)


class ValidationBleuCallback(TrainerCallback):
    """BLEU on a validation set every `eval_steps` optimizer steps, as fairseq's `--eval-bleu` and Marian's validation.

    Translates `sources` with the model being trained (greedy by default: fast, and it ranks checkpoints as beam search
    does) and logs through `log` (give it `trainer.log`: the entry then lands in `state.log_history` and every
    reporting callback) `eval_bleu` (sacreBLEU), `eval_lowercased_tokenized_bleu` and `elapsed_minutes` since training
    began, for the training-curve plot. Keeps the best step (`best_step`, `best_bleu`, by sacreBLEU) and, with
    `early_stopping_patience`, saves a checkpoint at each new best and stops training when BLEU has not improved for
    that many evaluations in a row (`CheckpointAveragingCallback(end_at_best_validation=True)` then averages up to the
    best).

    Written here rather than through transformers' evaluation loop and EarlyStoppingCallback: that loop runs a loss pass
    over the whole set and generates in unsorted padded batches, and EarlyStoppingCallback needs it (it reads the
    metrics of `on_evaluate` and requires `eval_strategy` and `metric_for_best_model`). This callback reuses
    `translate` (length-sorted batches) and the package's metrics. Every process translates, so that all of them take
    the same early-stopping decision.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sources: Sequence[str],
        references: Sequence[str],
        target_lang: str,
        eval_steps: int,
        log: Callable[[dict[str, float]], None],
        num_beams: int = 1,
        batch_size: int = 64,
        early_stopping_patience: int | None = None,
    ) -> None:
        if eval_steps <= 0:
            raise UsageError(f"eval_steps must be positive, got {eval_steps}")
        if early_stopping_patience is not None and early_stopping_patience <= 0:
            raise UsageError(f"early_stopping_patience must be positive, got {early_stopping_patience}")
        self.tokenizer = tokenizer
        self.sources, self.references = list(sources), list(references)
        self.target_lang = target_lang
        self.eval_steps = eval_steps
        self.log = log
        self.num_beams = num_beams
        self.batch_size = batch_size
        self.early_stopping_patience = early_stopping_patience
        self.best_step: int | None = None
        self.best_bleu: float | None = None
        self.evaluations_without_improvement = 0
        self.started = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        # A resumed run has its log history back from the checkpoint: the best step, the count of evaluations since
        # it (early stopping's patience) and the clock of the curve continue from the validations logged before.
        validations = [entry for entry in state.log_history if "eval_bleu" in entry]
        best = best_validation(validations)
        self.best_step, self.best_bleu = (best["step"], best["eval_bleu"]) if best else (None, None)
        self.evaluations_without_improvement = len(validations) - 1 - validations.index(best) if best else 0
        self.started = time.perf_counter() - 60 * (validations[-1]["elapsed_minutes"] if validations else 0.0)

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        if state.global_step % self.eval_steps != 0:
            return
        was_training = model.training
        try:
            hypotheses = translate(
                model, self.tokenizer, self.sources, self.batch_size, progress=False, num_beams=self.num_beams
            )
        finally:
            model.train(was_training)  # translate leaves the model in eval mode: dropout must come back
        bleu = corpus_scores(hypotheses, self.references)["bleu"]
        lowercased = lowercased_tokenized_bleu(hypotheses, self.references, self.target_lang)["bleu"]
        self.log(
            {
                "eval_bleu": bleu,
                "eval_lowercased_tokenized_bleu": lowercased,
                "elapsed_minutes": (time.perf_counter() - self.started) / 60,
            }
        )
        if self.best_bleu is None or bleu > self.best_bleu:
            self.best_step, self.best_bleu = state.global_step, bleu
            self.evaluations_without_improvement = 0
            if self.early_stopping_patience:
                control.should_save = True  # the best step becomes a checkpoint, for an average that ends there
        else:
            self.evaluations_without_improvement += 1
        if self.early_stopping_patience and self.evaluations_without_improvement >= self.early_stopping_patience:
            logger.info(f"validation BLEU has not improved for {self.early_stopping_patience} evaluations: stopping")
            control.should_training_stop = True
            control.should_save = True  # the last step's weights become a checkpoint for the average


VALIDATION_LOSS_KEYS = ("eval_loss", "eval_nll_loss")  # what ValidationLossCallback logs


def best_validation_loss(log_history: list[dict]) -> dict | None:
    """The entry `ValidationLossCallback` logged with the lowest validation loss (the first of equal ones: only a
    strictly lower loss improves, as fairseq's patience counts)."""
    validations = [entry for entry in log_history if all(key in entry for key in VALIDATION_LOSS_KEYS)]
    return min(validations, key=lambda entry: entry["eval_loss"], default=None)


def validation_loss(
    model: PreTrainedModel, batches: Sequence[dict[str, torch.Tensor]], label_smoothing: float
) -> tuple[float, float]:
    """The label-smoothed loss and the cross-entropy per target token over all `batches` (collated, labels -100 where
    padded), dropout off: each a sum over every target token of the set divided by their number, as fairseq's
    validation (not a mean of batch means). In nats; fairseq prints them in bits (divided by ln 2)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # smoothed loss, cross-entropy, target tokens
    try:
        with torch.inference_mode():
            for batch in batches:
                batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
                # num_items_in_batch 1: the model returns the sums over the batch's tokens, not their mean
                output = model(**batch, smoothing=label_smoothing, num_items_in_batch=1)
                nll = output.loss if output.nll_loss is None else output.nll_loss  # None: the loss is the NLL
                labels = batch["labels"]
                tokens = ((labels != -100) & (labels != model.config.pad_token_id)).sum()  # those the loss counts
                sums += torch.stack([output.loss, nll, tokens]).to("cpu", torch.float64)
    finally:
        model.train(was_training)
    loss, nll, tokens = sums.tolist()
    return loss / tokens, nll / tokens


class ValidationLossCallback(TrainerCallback):
    """fairseq's validation: the loss per target token of a validation set, at every checkpoint, with its patience.

    Whenever a checkpoint is about to be saved (every `save_steps`, every epoch with `save_strategy="epoch"`, at the
    last step), computes `validation_loss` with `label_smoothing` (that of training) on `dataset` (tokenized:
    `input_ids` and `labels`) in batches of about `max_tokens` tokens a side (`TokenBatchSampler`, shortest first), and
    logs through `log` (give it `trainer.log`: the entry lands in `state.log_history` and the checkpoint saved next)
    `eval_loss` and `eval_nll_loss`. With `early_stopping_patience`, training stops when that many validations in a row
    have not brought a strictly lower loss than the best (fairseq's `--patience`); the checkpoint of the stop is saved,
    and `CheckpointAveragingCallback` averages the last ones before it, as fairseq does. Every process computes the
    whole set, so that all take the same decision.

    Add it after every callback that may ask for a checkpoint (`ValidationBleuCallback`, the time budget): Trainer
    runs callbacks in order, and this one validates at the saves asked for before it.
    """

    def __init__(
        self,
        dataset: Dataset,
        data_collator: Callable[[list[dict]], dict[str, torch.Tensor]],
        max_tokens: int,
        label_smoothing: float,
        log: Callable[[dict[str, float]], None],
        early_stopping_patience: int | None = None,
    ) -> None:
        if early_stopping_patience is not None and early_stopping_patience <= 0:
            raise UsageError(f"early_stopping_patience must be positive, got {early_stopping_patience}")
        sampler = TokenBatchSampler(
            [len(ids) for ids in dataset["input_ids"]],
            [len(ids) for ids in dataset["labels"]],
            max_tokens=max_tokens,
            shuffle=False,
        )
        columns = dataset.select_columns(["input_ids", "attention_mask", "labels"])
        self.batches = [data_collator([columns[index] for index in batch]) for batch in sampler]  # collated once
        self.label_smoothing = label_smoothing
        self.log = log
        self.early_stopping_patience = early_stopping_patience
        self.best_step: int | None = None
        self.best_loss: float | None = None
        self.validations_without_improvement = 0
        self.last_validated_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        # A resumed run has its log history back from the checkpoint, whose validation was logged before it was saved:
        # the best loss and the patience count continue exactly from there.
        validations = [entry for entry in state.log_history if all(key in entry for key in VALIDATION_LOSS_KEYS)]
        best = best_validation_loss(validations)
        self.best_step, self.best_loss = (best["step"], best["eval_loss"]) if best else (None, None)
        self.validations_without_improvement = len(validations) - 1 - validations.index(best) if best else 0
        self.last_validated_step = validations[-1]["step"] if validations else None

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self._validate_before_a_save(state, control, model)

    def on_epoch_end(self, args, state, control, model=None, **kwargs) -> None:
        self._validate_before_a_save(state, control, model)

    def _validate_before_a_save(self, state, control, model: PreTrainedModel) -> None:
        # A stop at max_steps mid-epoch asks for the same checkpoint at the step and again at the epoch's end.
        if not control.should_save or state.global_step == self.last_validated_step:
            return
        self.last_validated_step = state.global_step
        loss, nll = validation_loss(model, self.batches, self.label_smoothing)
        self.log({"eval_loss": loss, "eval_nll_loss": nll})
        if self.best_loss is None or loss < self.best_loss:
            self.best_step, self.best_loss = state.global_step, loss
            self.validations_without_improvement = 0
        else:
            self.validations_without_improvement += 1
        patience = self.early_stopping_patience
        if patience and self.validations_without_improvement >= patience:
            logger.info(f"the validation loss has not improved for {patience} validations: stopping")
            control.should_training_stop = True
