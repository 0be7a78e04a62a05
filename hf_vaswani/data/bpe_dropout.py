"""Training pairs segmented afresh every epoch with BPE-dropout, and the token batches packed on each epoch's lengths.

Not in the paper (Provilkov et al., 2020, "BPE-Dropout: Simple and Effective Subword Regularization"): a regulariser
for small corpora, on which one fixed segmentation is seen many times.
"""

import math
import warnings
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from ..model.errors_vaswani import UsageError
from .batching import TokenBatchSampler


def check_one_process(world_size: int) -> None:
    """Refuses BPE-dropout over several processes: each would segment the pairs, and so batch them, its own way."""
    if world_size > 1:
        raise UsageError("--bpe-dropout segments in one process; with several, train without it")


class BpeDropoutPairs(torch.utils.data.Dataset):
    """Training pairs segmented afresh every epoch with BPE-dropout: each merge of the BPE model is skipped with
    probability `dropout`.

    `tokenizers`' BPE model does the dropout, on a copy of `tokenizer`'s backend (so validation and test keep
    deterministic BPE), and draws from its own generator, which cannot be seeded: a run with BPE-dropout does not
    repeat bit for bit, and a resumed run segments its epochs afresh.
    `resegmented_batch_sampler` packs each epoch's batches on that epoch's lengths (dropout makes segmentations
    longer): packed on the deterministic lengths, the resegmented batches would overflow their token budget.
    """

    def __init__(
        self, sources: Sequence[str], targets: Sequence[str], tokenizer: PreTrainedTokenizerBase, dropout: float
    ) -> None:
        if not 0 < dropout < 1:
            raise UsageError(f"BPE-dropout must be in (0, 1), got {dropout}")
        self.sources, self.targets = list(sources), list(targets)
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # model, pre-tokenizer and </s>
        self.backend.model.dropout = dropout
        self.epoch: int | None = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Segment the pairs for `epoch` (once: the sampler and accelerate's data loader both call it)."""
        if epoch != self.epoch:
            self.encoded_sources = self.backend.encode_batch(self.sources)
            self.encoded_targets = self.backend.encode_batch(self.targets)
            self.epoch = epoch

    def lengths(self) -> tuple[list[int], list[int]]:
        """Source and target lengths of this epoch's segmentation, </s> included."""
        return [len(pair.ids) for pair in self.encoded_sources], [len(pair.ids) for pair in self.encoded_targets]

    def epoch_lengths(self, epoch: int) -> tuple[list[int], list[int]]:
        """Source and target lengths of `epoch`'s segmentation, segmenting the pairs for it."""
        self.set_epoch(epoch)
        return self.lengths()

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        source = self.encoded_sources[index]
        return {
            "input_ids": source.ids,
            "attention_mask": source.attention_mask,
            "labels": self.encoded_targets[index].ids,
        }


def resegmented_batch_sampler(pairs: BpeDropoutPairs, max_tokens: int, seed: int = 0) -> TokenBatchSampler:
    """A `TokenBatchSampler` over `pairs` that packs each epoch on that epoch's segmentation.

    Trainer counts an epoch's steps once, from the first epoch, so every epoch has the same number of batches: the
    first epoch's count plus a margin for the segmentations' variation (on Multi30k, 138 or 139 batches), reached by
    splitting the largest batches as with several replicas.
    """
    lengths = pairs.lengths()
    with warnings.catch_warnings():  # about pairs longer than max_tokens, which the sampler returned warns about
        warnings.simplefilter("ignore")
        packed = len(TokenBatchSampler(*lengths, max_tokens=max_tokens, shuffle=False))
    return TokenBatchSampler(
        *lengths,
        max_tokens=max_tokens,
        seed=seed,
        epoch_lengths=pairs.epoch_lengths,
        batches_per_epoch=math.ceil(1.03 * packed) + 1,
    )
