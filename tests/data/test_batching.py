import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_vaswani.data.batching import TokenBatchSampler


def load_script(path: Path) -> ModuleType:
    # The scripts folder is not a package, so the script is loaded from its file.
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


padding_script = load_script(Path(__file__).resolve().parents[2] / "scripts" / "padding_fraction.py")
padding_fraction = padding_script.padding_fraction
random_batches = padding_script.random_batches


def lognormal_lengths(num_examples: int, seed: int = 0) -> tuple[list[int], list[int]]:
    # Sentence lengths in parallel corpora are roughly lognormal, and a target tracks its source's length.
    rng = np.random.default_rng(seed)
    source = np.clip(np.rint(rng.lognormal(3.0, 0.6, num_examples)), 1, 250).astype(int)
    target = np.clip(np.rint(source * rng.lognormal(0.0, 0.15, num_examples)), 1, 250).astype(int)
    return source.tolist(), target.tolist()


SOURCE, TARGET = lognormal_lengths(3000)
MAX_TOKENS = 1500


def assert_within_budget(batches: list[list[int]], max_tokens: int) -> None:
    for batch in batches:
        assert batch, "empty batch"
        assert len(batch) * max(SOURCE[i] for i in batch) <= max_tokens
        assert len(batch) * max(TARGET[i] for i in batch) <= max_tokens


def test_every_batch_respects_the_padded_budget_on_both_sides() -> None:
    sampler = TokenBatchSampler(SOURCE, TARGET, MAX_TOKENS, seed=3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert_within_budget(batches, MAX_TOKENS)
        # Greedy packing should fill batches, not just respect the cap.
        assert np.mean([len(b) for b in batches]) > 0.5 * MAX_TOKENS / np.mean(SOURCE)


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, 400])
def test_each_example_exactly_once_per_epoch_across_replicas(num_replicas: int, max_tokens: int) -> None:
    for epoch in (0, 1):
        per_rank = []
        for rank in range(num_replicas):
            sampler = TokenBatchSampler(SOURCE, TARGET, max_tokens, seed=1, num_replicas=num_replicas, rank=rank)
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert len(batches) == len(sampler)
            assert_within_budget(batches, max_tokens)
            per_rank.append(batches)
        assert len({len(batches) for batches in per_rank}) == 1, "ranks must run the same number of steps"
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(seen) == list(range(len(SOURCE)))


def test_splitting_reaches_a_multiple_of_the_replicas() -> None:
    # Three batches of two on one rank's worth of data: two replicas need a fourth batch, so one batch is halved.
    source = [5, 5, 5, 5, 5, 5]
    sampler = TokenBatchSampler(source, source, max_tokens=10, shuffle=False, num_replicas=2)
    assert len(sampler.all_batches()) == 4
    assert sorted(len(b) for b in sampler.all_batches()) == [1, 1, 2, 2]
    assert sorted(i for b in sampler.all_batches() for i in b) == list(range(6))


def test_impossible_equal_split_is_refused() -> None:
    # Every example fills a batch alone, so 5 batches can never be split evenly over 2 ranks.
    sampler = TokenBatchSampler([10] * 5, [10] * 5, max_tokens=10, num_replicas=2)
    with pytest.raises(ValueError, match="same number of batches"):
        len(sampler)


def test_order_depends_on_seed_and_epoch_only() -> None:
    sampler = TokenBatchSampler(SOURCE, TARGET, MAX_TOKENS, seed=7)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    # Not just the batch order: the random tie-break changes which examples share a batch.
    assert {tuple(sorted(b)) for b in epoch0} != {tuple(sorted(b)) for b in epoch1}

    again = TokenBatchSampler(SOURCE, TARGET, MAX_TOKENS, seed=7)
    again.set_epoch(1)
    assert list(again) == epoch1
    again.set_epoch(0)
    assert list(again) == epoch0

    other_seed = TokenBatchSampler(SOURCE, TARGET, MAX_TOKENS, seed=8)
    assert list(other_seed) != epoch0


def test_no_shuffle_yields_length_sorted_batches() -> None:
    sampler = TokenBatchSampler(SOURCE, TARGET, MAX_TOKENS, shuffle=False)
    longest = [max(max(SOURCE[i], TARGET[i]) for i in batch) for batch in sampler]
    assert longest == sorted(longest)
    sampler.set_epoch(5)
    assert [max(max(SOURCE[i], TARGET[i]) for i in batch) for batch in sampler] == longest


def test_token_batches_pad_far_less_than_random_batches() -> None:
    sampler = TokenBatchSampler(SOURCE, TARGET, MAX_TOKENS, seed=0)
    token_batches = list(sampler)
    baseline = random_batches(len(SOURCE), len(token_batches), seed=0)
    token_padding = padding_fraction(token_batches, SOURCE, TARGET)
    random_padding = padding_fraction(baseline, SOURCE, TARGET)
    assert token_padding < 0.5 * random_padding
    assert token_padding < 0.15


def test_padding_fraction_matches_a_hand_count() -> None:
    source = [3, 1, 4, 2]
    target = [2, 5, 1, 1]
    # Batch [0, 1]: source 2*3 = 6 slots for 4 tokens, target 2*5 = 10 slots for 7 tokens.
    # Batch [2, 3]: source 2*4 = 8 slots for 6 tokens, target 2*1 = 2 slots for 2 tokens.
    expected = 1 - (4 + 7 + 6 + 2) / (6 + 10 + 8 + 2)
    assert padding_fraction([[0, 1], [2, 3]], source, target) == pytest.approx(expected)
    assert padding_fraction([[0], [1], [2], [3]], source, target) == 0.0


def test_random_batches_partition_the_examples() -> None:
    batches = random_batches(10, 3, seed=1)
    assert sorted(len(b) for b in batches) == [3, 3, 4]
    assert sorted(i for b in batches for i in b) == list(range(10))


def test_oversized_example_gets_its_own_batch_with_one_warning() -> None:
    source = [2, 2, 50, 2, 2]
    target = [2, 2, 3, 2, 2]
    with pytest.warns(UserWarning, match="1 example"):
        sampler = TokenBatchSampler(source, target, max_tokens=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(3):
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert [2] in batches
            assert sorted(i for b in batches for i in b) == list(range(5))


def test_lengths_that_change_every_epoch_are_packed_per_epoch_in_a_fixed_count() -> None:
    lengths = {epoch: lognormal_lengths(300, seed=epoch) for epoch in range(3)}
    sampler = TokenBatchSampler(*lengths[0], MAX_TOKENS, epoch_lengths=lengths.__getitem__, batches_per_epoch=9)
    for epoch, (source, target) in lengths.items():
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 9  # each epoch packs into 7, two of them split
        assert sorted(i for b in batches for i in b) == list(range(300))
        for batch in batches:
            assert len(batch) * max(source[i] for i in batch) <= MAX_TOKENS
            assert len(batch) * max(target[i] for i in batch) <= MAX_TOKENS
    with pytest.raises(RuntimeError, match="epoch 0 packs into [0-9]+ batches, more than batches_per_epoch=1"):
        TokenBatchSampler(*lengths[0], MAX_TOKENS, epoch_lengths=lengths.__getitem__, batches_per_epoch=1).all_batches()
    with pytest.raises(ValueError, match="batches_per_epoch must be a positive multiple of num_replicas \\(2\\)"):
        TokenBatchSampler(*lengths[0], MAX_TOKENS, num_replicas=2, batches_per_epoch=7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"target_lengths": [1, 2]}, "same length"),
        ({"rank": 2, "num_replicas": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"seed": -1}, "seed"),
        ({"num_replicas": 4}, "4 replicas"),
        ({"source_lengths": [1, 0, 2]}, "at least 1"),
    ],
)
def test_invalid_arguments_are_refused(kwargs: dict, message: str) -> None:
    arguments = {"source_lengths": [1, 2, 3], "target_lengths": [1, 2, 3], "max_tokens": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        TokenBatchSampler(**arguments)


def test_works_as_batch_sampler_of_a_dataloader() -> None:
    rng = np.random.default_rng(0)
    pad_id = 0
    dataset = Dataset.from_dict(
        {
            "input_ids": [rng.integers(1, 50, n).tolist() for n in SOURCE[:300]],
            "labels": [rng.integers(1, 50, n).tolist() for n in TARGET[:300]],
        }
    )

    def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        def pad(key: str, value: int) -> torch.Tensor:
            width = max(len(example[key]) for example in examples)
            return torch.tensor([example[key] + [value] * (width - len(example[key])) for example in examples])

        input_ids = pad("input_ids", pad_id)
        return {"input_ids": input_ids, "attention_mask": (input_ids != pad_id).long(), "labels": pad("labels", -100)}

    source_lengths = [len(ids) for ids in dataset["input_ids"]]
    target_lengths = [len(ids) for ids in dataset["labels"]]
    sampler = TokenBatchSampler(source_lengths, target_lengths, max_tokens=600, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    assert len(loader) == len(sampler)
    examples = real_tokens = 0
    for batch in loader:
        assert batch["input_ids"].numel() <= 600
        assert batch["labels"].numel() <= 600
        examples += batch["input_ids"].shape[0]
        real_tokens += int(batch["attention_mask"].sum())
    assert examples == len(dataset)
    assert real_tokens == sum(source_lengths)
