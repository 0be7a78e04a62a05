"""The paper's training recipe (§5) on transformers' Seq2SeqTrainer.

Stock pieces do most of the work: Seq2SeqTrainer runs the loop, `DataCollatorForSeq2Seq` pads, AdamW with zero weight
decay is the paper's Adam (§5.3: beta1 0.9, beta2 0.98, eps 1e-9), `label_smoothing_factor` is §5.4's label smoothing
(the model computes the smoothed loss) and `gradient_accumulation_steps` is fairseq's `update_freq`. Written here
because transformers lacks them: batches of about `max_tokens` source and target tokens (§5.1, `TokenBatchSampler`)
and the exact learning-rate formula (§5.3, Eq. 3, `paper_lr_scheduler`).
"""

import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from datasets import Dataset, DatasetDict
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.dynamic_module_utils import custom_object_save

from ..data.batching import BoundedShapeCollator, TokenBatchSampler
from ..data.bpe_dropout import BpeDropoutPairs, check_one_process, resegmented_batch_sampler
from ..gpu_policy import PADDING_MULTIPLE, pads_batches
from ..kernels.cpu_features import cpu_bf16_matmul_works
from ..model.checks_vaswani import check_token_ids
from ..model.errors_vaswani import UsageError
from .schedule import paper_lr_scheduler


def paper_training_arguments(output_dir: str | Path, **overrides) -> Seq2SeqTrainingArguments:
    """Seq2SeqTrainingArguments with §5.3's Adam, §5.4's label smoothing and the paper's schedule multiplier; any
    argument can be overridden."""
    settings = dict(
        output_dir=str(output_dir),
        optim="adamw_torch_fused",  # one kernel for the whole update, CPU included
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-9,
        weight_decay=0.0,
        learning_rate=1.0,  # multiplies Eq. 3 in VaswaniTrainer
        label_smoothing_factor=0.1,
        warmup_steps=4000,
        max_grad_norm=0.0,  # the paper clips nothing
        save_strategy="steps",
        report_to=[],
        # On a machine without an accelerator this also makes several processes (torchrun, accelerate launch) talk
        # over gloo; without it each process would train alone.
        use_cpu=not (torch.cuda.is_available() or torch.backends.mps.is_available()),
        ddp_find_unused_parameters=False,  # every parameter takes part in every step
        # Trainer's filter reads every step's loss on the host, a wait for an accelerator each step; a step whose loss
        # is not finite shows as such in the logged loss and nll_loss.
        logging_nan_inf_filter=False,
    )
    arguments = {**settings, **overrides}
    if arguments.get("bf16") and arguments["use_cpu"] and not cpu_bf16_matmul_works():
        raise UsageError(
            "bf16 on this CPU: a bfloat16 matmul stops the process with an illegal instruction (the CPU advertises AMX "
            "that this machine does not enable, as on some virtual machines). Set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "
            "in the environment to use AVX-512 BF16 without AMX, or train in fp32."
        )
    return Seq2SeqTrainingArguments(**arguments)


def tokenize_corpus(corpus: DatasetDict | Dataset, tokenizer: PreTrainedTokenizerBase) -> DatasetDict | Dataset:
    """`source`/`target` text columns to `input_ids`, `attention_mask` and `labels` (each ending with </s>)."""

    def encode(batch: dict[str, list[str]]) -> dict:
        return tokenizer(batch["source"], text_target=batch["target"])

    columns = corpus.column_names
    if isinstance(columns, dict):
        columns = next(iter(columns.values()))
    return corpus.map(encode, batched=True, remove_columns=columns, desc="Tokenizing")


def tied_copies_are_loaded(model: PreTrainedModel, load_result: NamedTuple) -> None:
    """A `load_state_dict` post hook: a tied weight whose source was loaded is not missing (a checkpoint stores a tied
    weight once, under its source: lm_head.weight is the shared embedding), though strict=False reports it missing."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    missing = set(load_result.missing_keys)
    falsely_missing = {target for target, source in tied.items() if target in missing and source not in missing}
    if falsely_missing:
        model.tie_weights()
        load_result.missing_keys[:] = [key for key in load_result.missing_keys if key not in falsely_missing]


def initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give `optimizer` its per-parameter state (Adam's step and moments) without changing a parameter: one step on
    zero gradients at learning rate 0, the gradients then cleared. A state loaded afterwards replaces it whole."""
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for parameter in group["params"]:
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for group, learning_rate in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = learning_rate
    optimizer.zero_grad(set_to_none=True)


@contextmanager
def wrapped_class_code_saved(
    model: PreTrainedModel, save_directory: str | Path, is_main_process: bool = True
) -> Iterator[None]:
    """While `model` is saved (`save_pretrained`) into `save_directory`: under FSDP2, whose fully_shard gives a model
    a class of its own defined in torch (FSDPVaswaniForConditionalGeneration), the folder names and carries the code of
    the class it wrapped, as a plain model's folder does, and not torch's file. Other models save as they are."""
    wrapper = type(model)
    if not isinstance(model, FSDPModule) or not wrapper.is_remote_code():
        yield
        return
    wrapped = next(cls for cls in wrapper.__mro__ if not issubclass(cls, FSDPModule))
    if is_main_process:
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        # custom_object_save reads only the object's class: an instance made without __init__ is enough
        custom_object_save(object.__new__(wrapped), save_directory, config=model.config)
    wrapper._auto_class = None  # save_pretrained saves no code of the wrapper's
    try:
        yield
    finally:
        del wrapper._auto_class  # the wrapped class's again


class TokenIdCheckingCollator:
    """`collator`'s batches with their token ids checked against the model's vocabulary, on the CPU where they are made:
    the model reads no ids on an accelerator (model/checks_vaswani.py), where an id outside the vocabulary would stop
    the device with an assertion deep inside an embedding."""

    def __init__(self, collator: Callable[[list], dict], source_vocab_size: int, vocab_size: int) -> None:
        self.collator, self.source_vocab_size, self.vocab_size = collator, source_vocab_size, vocab_size

    def __call__(self, features: list) -> dict:
        batch = self.collator(features)
        check_token_ids("input_ids", batch.get("input_ids"), self.source_vocab_size)
        check_token_ids("decoder_input_ids", batch.get("decoder_input_ids"), self.vocab_size)
        check_token_ids("labels", batch.get("labels"), self.vocab_size, ignored_id=-100)
        return batch


class TrainingDiverged(UsageError):
    """The training loss, its cross-entropy or the gradient norm is not finite: the run stops, as fairseq's does on a
    NaN loss, keeping the checkpoints saved before and saving none of the diverged weights."""


class VaswaniTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer with the paper's token-based batches (§5.1) and learning-rate schedule (§5.3, Eq. 3).

    With `max_tokens`, each training batch holds sentence pairs of similar length with at most `max_tokens` (padded)
    source tokens and as many target tokens, sharded over processes so that each pair is seen once per epoch;
    `per_device_train_batch_size` is then unused. Compiled (`args.torch_compile`) or on a CUDA GPU, its batches take
    few shapes (`BoundedShapeCollator`): rows and lengths padded to a multiple of 8 (`gpu_policy.pads_batches`).

    The schedule uses `args.warmup_steps` and the model's d_model, scaled by `args.learning_rate`, and with
    `cooldown_steps` falls linearly to zero over the run's last steps (`paper_lr_scheduler`).

    Training steps smooth the loss by `args.label_smoothing_factor` (§5.4) in the model's own loss, which on the CPU
    never holds the full-vocabulary logits (0: the model's loss as configured); evaluation reports the model's loss, the
    cross-entropy unless its config sets smoothing. Each training log entry has `nll_loss` beside `loss`: the
    cross-entropy of the target tokens of the same steps, all processes' (fairseq logs both), in nats per token; its
    exp is the training perplexity.

    A run whose training loss, cross-entropy or gradient norm (but under fp16's loss scaling) turns non-finite stops
    with `TrainingDiverged` at the next training log, or before the next checkpoint if one comes first (from the
    cross-entropy summed since the last log): steps that read values on the host anyway, so a micro-batch reads none.
    Checkpoints saved before stay.
    """

    def __init__(self, *args, max_tokens: int | None = None, cooldown_steps: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_tokens is not None and max_tokens <= 0:
            raise UsageError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.cooldown_steps = cooldown_steps
        config = self.model.config
        if pads_batches(self.args.torch_compile, self.args.device):
            self.data_collator = BoundedShapeCollator(
                self.data_collator,
                PADDING_MULTIPLE,
                config.pad_token_id,
                config.eos_token_id,
                config.decoder_start_token_id,
            )
        self.data_collator = TokenIdCheckingCollator(self.data_collator, config.source_vocab_size, config.vocab_size)
        # Trainer resumes with load_state_dict(strict=False) and warns about every missing key it returns.
        self.model.register_load_state_dict_post_hook(tied_copies_are_loaded)
        # The model smooths its own loss (compute_loss): Trainer's LabelSmoother would need the logits.
        self.label_smoother = None
        self._batch_nll_and_tokens: torch.Tensor | None = None  # the last training batch's NLL sum and token count
        self._logged_nll_and_tokens: torch.Tensor | None = None  # their sums since the last training log

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.max_tokens is None:
            return super().get_train_dataloader()
        dataset = self.train_dataset
        if isinstance(dataset, BpeDropoutPairs):
            check_one_process(self.args.world_size)
            sampler = resegmented_batch_sampler(dataset, self.max_tokens, seed=self.args.seed)
        else:
            if self.args.remove_unused_columns:  # as Trainer's own loader: the collator gets only what forward takes
                forward = inspect.signature(self.model.forward).parameters
                dataset = dataset.remove_columns([name for name in dataset.column_names if name not in forward])
            sampler = TokenBatchSampler(
                [len(ids) for ids in dataset["input_ids"]],
                [len(ids) for ids in dataset["labels"]],
                max_tokens=self.max_tokens,
                seed=self.args.seed,
                num_replicas=self.args.world_size,
                rank=self.args.process_index,
            )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        loader = self.accelerator.prepare(loader)
        # The sampler already gives each rank its own batches; accelerate's BatchSamplerShard would shard them again.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # accelerate loads a sharded FSDP optimizer state into the state dict of the optimizer it is handed, and one
        # that has taken no step has no moments there to load into: they would restart at zero. Given its state
        # first, the optimizer takes the saved one (Trainer's private hook: tests/interop/test_private_api.py).
        if checkpoint is not None and self.is_fsdp_enabled and not self.optimizer.state:
            initialise_optimizer_state(self.optimizer)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every save of the model goes through this hook of Trainer's (tests/interop/test_private_api.py)
        with wrapped_class_code_saved(self.model, output_dir or self.args.output_dir, self.args.should_save):
            super()._save(output_dir, state_dict)

    def train(self, *args, **kwargs):
        self._logged_nll_and_tokens = None  # as Trainer starts its loss sum afresh
        try:
            return super().train(*args, **kwargs)
        finally:
            # The sum serves the checks of training's own saves, which every process makes. A save_model after
            # training, which a script may call in its main process alone, must not gather it from the others.
            self._logged_nll_and_tokens = None

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        # Training reads only the loss: on the CPU the model then never holds the full-vocabulary logits.
        if not return_outputs:
            inputs = {**inputs, "return_logits": False}
        if model.training and self.args.label_smoothing_factor:
            inputs = {**inputs, "smoothing": self.args.label_smoothing_factor}
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if model.training:
            # The model divides its NLL sum by num_items_in_batch (else by its own count), and Trainer scales the loss,
            # not the NLL: this batch's sum and tokens, the padding id left out as the model leaves it out
            labels, pad_token_id = inputs["labels"], self.model.config.pad_token_id
            tokens = ((labels != -100) & (labels != pad_token_id)).sum()
            nll = outputs["nll_loss"].sum()  # summed over the devices of torch.nn.DataParallel
            nll_sum = nll * (tokens if num_items_in_batch is None else num_items_in_batch)
            self._batch_nll_and_tokens = torch.stack([nll_sum, tokens.to(nll.dtype)])
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        batch = self._batch_nll_and_tokens
        if self.args.logging_nan_inf_filter:  # Trainer logs a non-finite step as the mean so far: left out here
            batch = torch.where(torch.isfinite(loss), batch, 0.0)
        if self._logged_nll_and_tokens is None:
            self._logged_nll_and_tokens = torch.zeros_like(batch)
        self._logged_nll_and_tokens += batch
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._logged_nll_and_tokens is not None:  # a training log, on every process at once
            nll_sum, tokens = self.accelerator.gather(self._logged_nll_and_tokens).view(-1, 2).sum(0).tolist()
            self._logged_nll_and_tokens = None
            if tokens:  # every token of the steps since the last log, on every process, weighted alike (as fairseq)
                logs = {"loss": logs["loss"], "nll_loss": nll_sum / tokens, **logs}
        super().log(logs, start_time)
        if "loss" in logs:  # a training log
            # fp16's loss scaler skips a step whose gradients overflow, and lowers the scale: a step it handles
            watched = ("loss", "nll_loss") if self.args.fp16 else ("loss", "nll_loss", "grad_norm")
            for name in watched:
                if name in logs and not math.isfinite(logs[name]):
                    self.diverged(f"the training {name} logged there is {logs[name]}")

    def save_model(self, *args, **kwargs) -> None:
        # Before a checkpoint between two logs: the cross-entropy summed since the last log, once, on every process.
        if self._logged_nll_and_tokens is not None:
            nll_sum = self.accelerator.gather(self._logged_nll_and_tokens).view(-1, 2)[:, 0].sum().item()
            if not math.isfinite(nll_sum):
                self.diverged(f"the training cross-entropy summed since the last log is {nll_sum}")
        super().save_model(*args, **kwargs)

    def diverged(self, what: str) -> None:
        raise TrainingDiverged(
            f"training diverged at step {self.state.global_step}: {what}; the checkpoints saved before it are kept in "
            f"{self.args.output_dir}, and no weights of the diverged model are saved"
        )

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        if self.lr_scheduler is None:
            warmup = self.args.get_warmup_steps(num_training_steps)
            self.lr_scheduler = paper_lr_scheduler(
                optimizer or self.optimizer,
                self.model.config.d_model,
                warmup,
                cooldown_steps=self.cooldown_steps,
                total_steps=num_training_steps,
            )
        return self.lr_scheduler
