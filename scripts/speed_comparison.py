"""What scripts/benchmark.py (the CPU) and scripts/gpu_figures.py (a GPU) share to compare hf_vaswani's speed with
transformers' MarianMTModel: the pair of models of one size, random token batches, timed calls, a training step, and
decoding forced to one output length. Both scripts run from scripts/, which Python puts first on the import path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import MarianMTModel, PreTrainedTokenizerFast

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.interop.export import to_marian

# hf_vaswani's search as transformers' and CTranslate2's: their length penalty (hf_vaswani's default is the paper's
# GNMT penalty) and no output cap from the source's length, so that every system searches alike
SEARCH_AS_TRANSFORMERS = {"length_penalty_type": "power", "max_new_tokens_over_source": None}
CPU = torch.device("cpu")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0 to 3, as VaswaniConfig's defaults (<s> starts decoding)
PAD, EOS, FIRST_WORD = 0, 2, len(SPECIAL_TOKENS)


def model_pair(config: VaswaniConfig, seed: int = 0) -> tuple[VaswaniForConditionalGeneration, MarianMTModel]:
    """A seeded hf_vaswani model of `config` and the MarianMTModel of the same function (`to_marian`), fp32 on the CPU,
    in eval mode, both with sdpa attention (transformers' default, set so that no figure depends on that default)."""
    torch.manual_seed(seed)
    ours = VaswaniForConditionalGeneration(config).eval()
    marian = to_marian(ours)
    for model in (ours, marian):
        model.set_attn_implementation("sdpa")
    return ours, marian


def random_tokens(
    generator: torch.Generator, rows: int, length: int, words_end: int, words_start: int = FIRST_WORD, eos: int = EOS
) -> torch.Tensor:
    """`rows` sentences of `length` - 1 word ids (`words_start` to `words_end` - 1) and </s>, as a tokenizer gives
    sources."""
    tokens = torch.randint(words_start, words_end, (rows, length), generator=generator)
    tokens[:, -1] = eos
    return tokens


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is exactly a random model's of `vocab_size`: SPECIAL_TOKENS and one made-up word
    w<id> for each other id, which a CTranslate2 export and the recipe's model need."""
    words = [*SPECIAL_TOKENS, *(f"w{i}" for i in range(FIRST_WORD, vocab_size))]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(work: Callable[[], object], warmup: int = 0, repeats: int = 1, device: torch.device = CPU) -> float:
    """Seconds a call of `work`: `warmup` calls, then `repeats` calls between two synchronisations of the device, so
    that the host queues each call's work while the device runs the last one's, as in a training or decoding loop."""
    for _ in range(warmup):
        work()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    synchronize(device)
    return (time.perf_counter() - started) / repeats


class TrainingStep:
    """A call is one training step on a fixed batch, as a training loop runs it: the forward (under bf16 autocast where
    `bf16`), the backward, a fused AdamW update with the paper's betas and epsilon, the gradients dropped. hf_vaswani
    is called as VaswaniTrainer.compute_loss calls it (the loss without the full-vocabulary logits, the label smoothing,
    the batch's token count as a device tensor); MarianMTModel computes its own cross-entropy. `compile_options`:
    torch.compile's, None for eager."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        bf16: bool = False,
        smoothing: float = 0.0,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, fused=True
        )
        self.forward = model if compile_options is None else torch.compile(model, **compile_options)
        # CUDA graphs replay into the same output memory: a new step's replay may overwrite the last step's tensors
        self.captured = (compile_options or {}).get("mode") == "reduce-overhead"
        self.inputs: dict[str, Any] = batch
        if isinstance(model, VaswaniForConditionalGeneration):
            tokens = (batch["labels"] != -100).sum()
            self.inputs = {**batch, "return_logits": False, "smoothing": smoothing, "num_items_in_batch": tokens}
        self.device_type = batch["input_ids"].device.type
        self.bf16 = bf16
        self.tokens = batch["input_ids"].numel() + batch["labels"].numel()

    def __call__(self) -> None:
        if self.captured:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.forward(**self.inputs).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def transformers_loop(model: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    """transformers' decoding loop: the model's own `generate`."""
    return model.generate(**inputs)


def forced_length(new_tokens: int) -> dict[str, int]:
    """`generate`'s options that make every system decode `new_tokens` steps, whatever its random model would end."""
    return {"min_new_tokens": new_tokens, "max_new_tokens": new_tokens}


def produced_tokens(output: torch.Tensor, new_tokens: int, system: str) -> int:
    """The tokens each sentence of `output` has after the start token, checked to be the `new_tokens` forced."""
    produced = output.shape[1] - 1
    if produced != new_tokens:
        raise RuntimeError(f"{system} generated {produced} tokens instead of {new_tokens}")
    return produced
