"""The paper's training recipe (§5) on transformers' Seq2SeqTrainer.

Stock pieces do most of the work: Seq2SeqTrainer runs the loop, `DataCollatorForSeq2Seq` pads, AdamW with zero weight
decay is the paper's Adam (§5.3: beta1 0.9, beta2 0.98, eps 1e-9), the model computes the label-smoothed loss (§5.4)
and `gradient_accumulation_steps` is fairseq's `update_freq`. Written here because transformers lacks them: batches of
about `max_tokens` source and target tokens (§5.1) and the exact learning-rate formula (§5.3, Eq. 3).
"""

import subprocess
import sys
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict
from torch.optim.lr_scheduler import LambdaLR
from transformers import PreTrainedTokenizerBase, Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

from .averaging import average_checkpoints, last_checkpoints
from .batching import TokenBatchSampler


def paper_learning_rate(step: int, d_model: int, warmup_steps: int) -> float:
    """§5.3, Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), steps counted from 1."""
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def paper_lr_scheduler(optimizer: torch.optim.Optimizer, d_model: int, warmup_steps: int) -> LambdaLR:
    """Eq. 3 as a scheduler; the optimizer's base learning rate multiplies it (1.0 gives the paper's values)."""
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be positive for the paper's schedule, got {warmup_steps}")
    # transformers' `inverse_sqrt` is this formula one update late (its first update has learning rate 0): LambdaLR
    # counts updates from 0, the paper from 1.
    return LambdaLR(optimizer, lambda update: paper_learning_rate(update + 1, d_model, warmup_steps))


def paper_training_arguments(output_dir: str | Path, **overrides) -> Seq2SeqTrainingArguments:
    """Seq2SeqTrainingArguments with §5.3's Adam and the paper's schedule multiplier; any argument can be overridden."""
    settings = dict(
        output_dir=str(output_dir),
        optim="adamw_torch_fused",  # one kernel for the whole update, CPU included
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-9,
        weight_decay=0.0,
        learning_rate=1.0,  # multiplies Eq. 3 in VaswaniTrainer
        warmup_steps=4000,
        max_grad_norm=0.0,  # the paper clips nothing
        save_strategy="steps",
        report_to=[],
        # On a machine without an accelerator this also makes several processes (torchrun, accelerate launch) talk
        # over gloo; without it each process would train alone.
        use_cpu=not (torch.cuda.is_available() or torch.backends.mps.is_available()),
        ddp_find_unused_parameters=False,  # every parameter takes part in every step
    )
    arguments = {**settings, **overrides}
    if arguments.get("bf16") and arguments["use_cpu"] and not cpu_bf16_matmul_works():
        raise ValueError(
            "bf16 on this CPU: a bfloat16 matmul stops the process with an illegal instruction (the CPU advertises AMX "
            "that this machine does not enable, as on some virtual machines). Set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "
            "in the environment to use AVX-512 BF16 without AMX, or train in fp32."
        )
    return Seq2SeqTrainingArguments(**arguments)


def cpu_bf16_matmul_works() -> bool:
    """Whether a bfloat16 matmul runs on this CPU, tried in a child process since the failure is a crash (SIGILL)."""
    probe = "import torch; torch.randn(8, 64, dtype=torch.bfloat16) @ torch.randn(64, 64, dtype=torch.bfloat16)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def tokenize_corpus(corpus: DatasetDict | Dataset, tokenizer: PreTrainedTokenizerBase) -> DatasetDict | Dataset:
    """`source`/`target` text columns to `input_ids`, `attention_mask` and `labels` (each ending with </s>)."""

    def encode(batch: dict[str, list[str]]) -> dict:
        return tokenizer(batch["source"], text_target=batch["target"])

    columns = corpus.column_names
    if isinstance(columns, dict):
        columns = next(iter(columns.values()))
    return corpus.map(encode, batched=True, remove_columns=columns, desc="Tokenizing")


class VaswaniTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer with the paper's token-based batches (§5.1) and learning-rate schedule (§5.3, Eq. 3).

    With `max_tokens`, each training batch holds sentence pairs of similar length with at most `max_tokens` (padded)
    source tokens and as many target tokens, sharded over processes so that each pair is seen once per epoch;
    `per_device_train_batch_size` is then unused. The schedule uses `args.warmup_steps` and the model's d_model, scaled
    by `args.learning_rate`.
    """

    def __init__(self, *args, max_tokens: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.max_tokens is None:
            return super().get_train_dataloader()
        dataset = self._remove_unused_columns(self.train_dataset, description="training")
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

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        if self.lr_scheduler is None:
            warmup = self.args.get_warmup_steps(num_training_steps)
            self.lr_scheduler = paper_lr_scheduler(optimizer or self.optimizer, self.model.config.d_model, warmup)
        return self.lr_scheduler


class CheckpointAveragingCallback(TrainerCallback):
    """§6.1: at the end of training, average the last `num_checkpoints` saved checkpoints into `output_dir/averaged`.

    Keep `save_total_limit` (if set) at least `num_checkpoints`, or the older ones are gone before the average.
    """

    def __init__(self, num_checkpoints: int = 5, subdirectory: str = "averaged") -> None:
        self.num_checkpoints = num_checkpoints
        self.subdirectory = subdirectory
        self.averaged_path: Path | None = None

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            checkpoints = last_checkpoints(args.output_dir, self.num_checkpoints)
            self.averaged_path = average_checkpoints(checkpoints, Path(args.output_dir) / self.subdirectory)
