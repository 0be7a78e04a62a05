"""Token-budget batching of sentence pairs, as in §5.1 of "Attention Is All You Need".

"Sentence pairs were batched together by approximate sequence length. Each training batch contained a set of sentence
pairs containing approximately 25000 source tokens and 25000 target tokens."

:class:`TokenBatchSampler` groups examples of similar length and fills each batch up to a token budget counted on the
*padded* tensors (``len(batch) * longest sequence``), which is what bounds activation memory. In the paper the 25000
tokens are spread over 8 GPUs, so under data parallelism ``max_tokens`` is the budget of one rank's step, about
25000 / 8 per GPU for the paper's setting (or use gradient accumulation to reach the same tokens per update).
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ..model.errors_vaswani import UsageError

__all__ = ["TokenBatchSampler"]


def _as_lengths(lengths: Sequence[int], name: str) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise UsageError(f"{name} must be a flat sequence of integers, got an array of shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise UsageError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _checked_lengths(source_lengths: Sequence[int], target_lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    source = _as_lengths(source_lengths, "source_lengths")
    target = _as_lengths(target_lengths, "target_lengths")
    if len(source) != len(target):
        raise UsageError(
            f"source_lengths and target_lengths must have the same length, got {len(source)} and {len(target)}"
        )
    # A zero length would let unboundedly many examples share a batch of zero padded size.
    if (source < 1).any() or (target < 1).any():
        raise UsageError("every source and target length must be at least 1 (count the end-of-sequence token)")
    return source, target


class TokenBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields lists of example indices whose padded source and target sizes each fit in ``max_tokens``.

    For every batch ``len(batch) * max(source_lengths[i] for i in batch) <= max_tokens`` and the same for the targets.
    The only exception is an example longer than ``max_tokens`` on either side: it gets a batch of its own (a warning is
    raised once, when the sampler is built) rather than being dropped, so that no data silently disappears; filter such
    pairs beforehand if they do not fit in memory.

    Each epoch the examples are sorted by ``max(source length, target length)`` with ties broken by a random key drawn
    from ``seed + epoch``, packed greedily into batches, and the batch order is shuffled with the same generator. Only
    the tie-break changes between epochs, so batch compositions vary while staying tight. With ``shuffle=False`` ties
    are broken by index and batches come out shortest first, the usual choice for evaluation.

    Data parallelism: all ranks build the same list of batches from ``(seed, epoch)``; rank ``r`` takes batches
    ``r, r + num_replicas, ...``. So that every rank runs the same number of steps (DDP hangs otherwise) without
    dropping or repeating examples, the largest batches are split in two until the count is divisible by
    ``num_replicas``; a split batch still fits the budget since its padded size can only shrink. Call
    :meth:`set_epoch` at the start of every epoch, as with ``DistributedSampler``. Do not let another layer (e.g.
    ``accelerate``'s ``prepare``) shard these batches again: build one sampler per rank with its ``rank`` instead, or
    one sampler with ``num_replicas=1`` and leave the sharding to that layer.

    Examples whose lengths change between epochs (segmented afresh every epoch, as with BPE-dropout) give
    ``epoch_lengths``, each epoch then packed on its own lengths, and ``batches_per_epoch``, so that every epoch has
    the number of batches that a training loop counted once.

    Args:
        source_lengths: number of tokens of each example's source, special tokens included.
        target_lengths: same for the targets (the labels), aligned with ``source_lengths``.
        max_tokens: padded-token budget per batch, applied to the source and to the target side separately.
        shuffle: vary the tie-break and shuffle the batch order every epoch.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        num_replicas: number of data-parallel processes.
        rank: index of this process in ``[0, num_replicas)``.
        epoch_lengths: called with an epoch, the source and target lengths of that epoch's examples; the arguments
            ``source_lengths`` and ``target_lengths`` are then those of the first epoch. None: the lengths never change.
        batches_per_epoch: batches of every epoch, all replicas together, reached by splitting the largest batches; an
            epoch that packs into more is refused (RuntimeError). None: the packed count, rounded up to a multiple of
            ``num_replicas``.
    """

    def __init__(
        self,
        source_lengths: Sequence[int],
        target_lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        epoch_lengths: Callable[[int], tuple[Sequence[int], Sequence[int]]] | None = None,
        batches_per_epoch: int | None = None,
    ) -> None:
        source, target = _checked_lengths(source_lengths, target_lengths)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer) or max_tokens <= 0:
            raise UsageError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise UsageError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise UsageError(f"rank must be an integer in [0, {num_replicas}), got {rank!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UsageError(f"seed must be a non-negative integer, got {seed!r}")
        if len(source) < num_replicas:
            raise UsageError(
                f"{len(source)} examples cannot be spread over {num_replicas} replicas: every rank needs at least one "
                "batch per epoch and an example cannot be split"
            )
        if batches_per_epoch is not None and (
            isinstance(batches_per_epoch, bool)
            or not isinstance(batches_per_epoch, int)
            or batches_per_epoch < 1
            or batches_per_epoch % num_replicas
        ):
            raise UsageError(
                f"batches_per_epoch must be a positive multiple of num_replicas ({num_replicas}), got "
                f"{batches_per_epoch!r}"
            )

        self.source_lengths = source
        self.target_lengths = target
        self.max_tokens = int(max_tokens)
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch_lengths = epoch_lengths
        self.batches_per_epoch = batches_per_epoch
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

        oversized = int(((source > self.max_tokens) | (target > self.max_tokens)).sum())
        if oversized:
            warnings.warn(
                f"{oversized} example(s) have more than max_tokens={self.max_tokens} tokens on one side; each gets a "
                "batch of its own that exceeds the budget",
                stacklevel=2,
            )

    def set_epoch(self, epoch: int) -> None:
        """Selects the tie-break and batch order of ``epoch``; call it before iterating each epoch."""
        self.epoch = epoch

    def all_batches(self, epoch: int | None = None) -> list[list[int]]:
        """Every rank's batches of ``epoch`` (default: the current one) in the shared order, before sharding."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._build(epoch))
        return self._cache[1]

    def __iter__(self) -> Iterator[list[int]]:
        # Copies, so that a caller sorting or editing a batch cannot corrupt the cached epoch.
        for batch in self.all_batches()[self.rank :: self.num_replicas]:
            yield list(batch)

    def __len__(self) -> int:
        return len(self.all_batches()) // self.num_replicas

    def _build(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + epoch)
        source, target = self._lengths_of(epoch)
        longest = np.maximum(source, target)
        if self.shuffle:
            order = np.lexsort((rng.random(len(longest)), longest))
        else:
            order = np.argsort(longest, kind="stable")
        batches = self._pack(order, source, target)
        batches = self._split_to(batches, self._batch_count(epoch, len(batches)))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def _lengths_of(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self.epoch_lengths is None:
            return self.source_lengths, self.target_lengths
        source, target = _checked_lengths(*self.epoch_lengths(epoch))
        if len(source) != len(self.source_lengths):
            raise UsageError(f"epoch {epoch} has {len(source)} examples, the first epoch {len(self.source_lengths)}")
        return source, target

    def _pack(self, order: np.ndarray, source_lengths: np.ndarray, target_lengths: np.ndarray) -> list[list[int]]:
        # Greedy in sorted order: with lengths nearly monotone, closing a batch as soon as the next example would break
        # either budget wastes little. Python lists beat per-element numpy indexing in this loop.
        source = source_lengths[order].tolist()
        target = target_lengths[order].tolist()
        indices = order.tolist()
        budget = self.max_tokens
        batches: list[list[int]] = []
        batch: list[int] = []
        max_source = max_target = 0
        for index, source_length, target_length in zip(indices, source, target, strict=True):
            new_source = max(max_source, source_length)
            new_target = max(max_target, target_length)
            size = len(batch) + 1
            if batch and (size * new_source > budget or size * new_target > budget):
                batches.append(batch)
                batch = []
                new_source, new_target = source_length, target_length
            batch.append(index)
            max_source, max_target = new_source, new_target
        if batch:
            batches.append(batch)
        return batches

    def _batch_count(self, epoch: int, packed: int) -> int:
        """How many batches `epoch`, packed into `packed`, is split into: `batches_per_epoch`, else the next multiple
        of the replica count."""
        if self.batches_per_epoch is None:
            return math.ceil(packed / self.num_replicas) * self.num_replicas
        if packed > self.batches_per_epoch:
            raise RuntimeError(
                f"epoch {epoch} packs into {packed} batches, more than batches_per_epoch={self.batches_per_epoch}; "
                "raise max_tokens"
            )
        return self.batches_per_epoch

    def _split_to(self, batches: list[list[int]], target_count: int) -> list[list[int]]:
        needed = target_count - len(batches)
        if not needed:
            return batches
        # Each split adds one batch, so counts from len(batches) up to one example per batch are reachable.
        if target_count > len(self.source_lengths):
            raise UsageError(
                f"cannot give {self.num_replicas} replicas the same number of batches: max_tokens={self.max_tokens} "
                f"already yields {len(batches)} batches for {len(self.source_lengths)} examples and no split reaches "
                f"{target_count}; raise max_tokens"
            )
        # Splitting the most populous batches keeps the halves large, so the extra steps cost the least. A piece is
        # keyed by its batch's position and its path in the split tree, so sorting the keys restores the length order.
        heap: list[tuple[int, tuple[int, tuple[int, ...]], list[int]]] = [
            (-len(batch), (position, ()), batch) for position, batch in enumerate(batches)
        ]
        heapq.heapify(heap)
        for _ in range(needed):
            _, (position, path), batch = heapq.heappop(heap)
            half = len(batch) // 2
            # The batch is length-sorted, so the first half holds the shorter examples and both halves stay tight.
            heapq.heappush(heap, (-half, (position, (*path, 0)), batch[:half]))
            heapq.heappush(heap, (half - len(batch), (position, (*path, 1)), batch[half:]))
        return [batch for _, _, batch in sorted(heap, key=lambda entry: entry[1])]


class BoundedShapeCollator:
    """`collator`'s batches padded to few distinct shapes: rows, source and target lengths each to a multiple of
    `multiple`. A compiled training step compiles, and a captured one records a CUDA graph, for each shape it meets;
    batches cut by a token budget (`TokenBatchSampler`) otherwise take almost as many shapes as there are batches.

    An added row is one attended source token (`eos_token_id`: an attention row with every key masked would give NaN),
    then padding, and labels that are all -100: it adds nothing to the loss or the gradients.
    """

    def __init__(
        self,
        collator: Callable[[list], dict],
        multiple: int,
        pad_token_id: int,
        eos_token_id: int,
        decoder_start_token_id: int,
    ) -> None:
        self.collator, self.multiple = collator, multiple
        self.fills = {"input_ids": pad_token_id, "attention_mask": 0, "labels": -100, "decoder_input_ids": pad_token_id}
        self.firsts = {"input_ids": eos_token_id, "attention_mask": 1, "decoder_input_ids": decoder_start_token_id}

    def __call__(self, features: list) -> dict:
        batch = self.collator(features)
        for name, fill in self.fills.items():
            if name in batch:
                tensor = batch[name]
                rows, length = (-(-size // self.multiple) * self.multiple for size in tensor.shape)
                padded = tensor.new_full((rows, length), fill)
                padded[: tensor.shape[0], : tensor.shape[1]] = tensor
                padded[tensor.shape[0] :, 0] = self.firsts.get(name, fill)
                batch[name] = padded
        return batch
