"""A vocabulary shortlist: decoding a batch scores only the target tokens likely for its sources.

The output projection and the passes over its scores (log-softmax, top-k) grow with the vocabulary: with 37,000
tokens the projection is about half of a beam step's products. Production engines narrow it per batch: Marian's
lexical shortlists (Bergamot, Firefox Translations), CTranslate2's vocabulary mapping. Here a batch's list is the
union of a corpus's `frequent` most frequent target tokens, the special tokens, and for each token of the batch's
sources its `per_source` target tokens of highest Dice coefficient over the corpus's sentence pairs,
2 c(s, t) / (c(s) + c(t)) in sentences (co-occurrence, not word alignment, so that it needs nothing but the corpus;
Dice rather than c(s, t) / c(s), which would rank the frequent tokens first again). The package's decoding loop
(search.py) multiplies by the listed rows of the output projection only and normalises the scores over them,
as both engines do.

Saved beside the model as shortlist.safetensors; `vaswani shortlist` builds it from a corpus, `vaswani translate
--shortlist` and `hf_vaswani.generate(..., shortlist=Shortlist.load(folder, vocab_size))` use it, `vaswani export --to
ctranslate2` writes it as CTranslate2's vocabulary map.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerBase

from ..files import replace_file
from ..model.errors_vaswani import UsageError

SHORTLIST_FILE = "shortlist.safetensors"
SHORTLIST_PER_SOURCE = 50  # the default sizes (docs/performance.md: chosen on Multi30k's validation set)
SHORTLIST_FREQUENT = 100
PAIRS_PER_CHUNK = 20_000  # sentence pairs counted at a time: their co-occurrence keys stay within a few hundred MB


@dataclass(frozen=True)
class Shortlist:
    """`always`: the target ids every list holds (the most frequent, the special tokens), sorted; `candidates`: per
    source id, its likeliest target ids, best first, -1 where it has fewer."""

    always: torch.Tensor
    candidates: torch.Tensor

    def columns(self, source_ids: torch.Tensor, source_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The sorted target ids a batch of sources may produce."""
        tokens = source_ids if source_mask is None else source_ids[source_mask.bool()]
        listed = self.candidates.to(source_ids.device)[tokens.reshape(-1)].reshape(-1)
        return torch.unique(torch.cat((self.always.to(source_ids.device), listed[listed >= 0])))

    def save(self, folder: str | Path) -> Path:
        """Into `folder`/shortlist.safetensors, whole or not at all."""
        tensors = {"always": self.always.contiguous(), "candidates": self.candidates.contiguous()}
        return replace_file(Path(folder) / SHORTLIST_FILE, lambda temporary: save_file(tensors, str(temporary)))

    @classmethod
    def load(cls, folder: str | Path, vocab_size: int) -> "Shortlist":
        """The shortlist saved in `folder`; a UsageError naming the file when it is unreadable or does not fit a
        vocabulary of `vocab_size`."""
        path = Path(folder) / SHORTLIST_FILE
        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as error:
            raise UsageError(f"{path}: not a readable shortlist ({error})") from None
        always, candidates = tensors.get("always"), tensors.get("candidates")
        if (
            always is None
            or candidates is None
            or always.dim() != 1
            or candidates.dim() != 2
            or candidates.shape[0] != vocab_size
            or always.numel() == 0
            or int(always.min()) < 0
            or int(always.max()) >= vocab_size
            or (candidates.numel() > 0 and not -1 <= int(candidates.min()) <= int(candidates.max()) < vocab_size)
        ):
            raise UsageError(f"{path}: not a shortlist for a vocabulary of {vocab_size} tokens")
        return cls(always.long(), candidates.long())

    @classmethod
    def saved_in(cls, folder: str | Path, vocab_size: int) -> "Shortlist | None":
        """The shortlist saved in `folder` (`load`), or None where the folder holds none."""
        return cls.load(folder, vocab_size) if (Path(folder) / SHORTLIST_FILE).is_file() else None


def shortlist_of_corpus(
    tokenizer: PreTrainedTokenizerBase,
    sources: list[str],
    targets: list[str],
    vocab_size: int,
    per_source: int,
    frequent: int,
) -> Shortlist:
    """The shortlist of a parallel corpus of sentences, tokenized by the model's `tokenizer`; the end, unknown and start
    tokens are always listed (as CTranslate2 lists them)."""
    source_ids = tokenizer(sources)["input_ids"]
    target_ids = tokenizer(text_target=targets)["input_ids"]
    special = [tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id]
    special_ids = [token for token in special if token is not None]
    return build_shortlist(zip(source_ids, target_ids, strict=True), vocab_size, special_ids, per_source, frequent)


def build_shortlist(
    pairs: Iterable[tuple[list[int], list[int]]],
    vocab_size: int,
    special_ids: list[int],
    per_source: int,
    frequent: int,
) -> Shortlist:
    """The shortlist of a tokenized parallel corpus (source ids, target ids per pair): see the module's docstring."""
    source_counts = torch.zeros(vocab_size, dtype=torch.long)  # sentences holding each token, per side
    target_counts = torch.zeros(vocab_size, dtype=torch.long)
    target_frequency = torch.zeros(vocab_size, dtype=torch.long)  # occurrences
    pair_keys, pair_counts = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    chunk: list[torch.Tensor] = []

    def count_chunk() -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat((pair_keys, *chunk))
        counts = torch.cat((pair_counts, torch.ones(keys.numel() - pair_counts.numel(), dtype=torch.long)))
        unique, inverse = torch.unique(keys, return_inverse=True)
        return unique, torch.zeros_like(unique).scatter_add_(0, inverse, counts)

    for source, target in pairs:
        source_set = torch.unique(torch.as_tensor(source, dtype=torch.long))
        target_ids = torch.as_tensor(target, dtype=torch.long)
        target_set = torch.unique(target_ids)
        source_counts[source_set] += 1
        target_counts[target_set] += 1
        target_frequency += torch.bincount(target_ids, minlength=vocab_size)
        chunk.append((source_set[:, None] * vocab_size + target_set[None, :]).reshape(-1))
        if len(chunk) == PAIRS_PER_CHUNK:
            pair_keys, pair_counts = count_chunk()
            chunk = []
    if chunk:
        pair_keys, pair_counts = count_chunk()

    sources, targets = pair_keys // vocab_size, pair_keys % vocab_size
    dice = 2.0 * pair_counts / (source_counts[sources] + target_counts[targets])
    order = torch.argsort(dice, descending=True, stable=True)
    order = order[torch.argsort(sources[order], stable=True)]  # grouped by source, best first within each
    grouped_sources = sources[order]
    group_starts = torch.searchsorted(grouped_sources, grouped_sources)
    ranks = torch.arange(order.numel()) - group_starts
    kept = ranks < per_source
    candidates = torch.full((vocab_size, per_source), -1, dtype=torch.long)
    candidates[grouped_sources[kept], ranks[kept]] = targets[order][kept]

    most_frequent = torch.argsort(target_frequency, descending=True, stable=True)[:frequent]
    most_frequent = most_frequent[target_frequency[most_frequent] > 0]
    always = torch.unique(torch.cat((most_frequent, torch.tensor(special_ids, dtype=torch.long))))
    return Shortlist(always, candidates)


def write_ctranslate2_vocabulary_map(shortlist: Shortlist, tokens: list[str], path: str | Path) -> None:
    """`shortlist` as CTranslate2's vocabulary map (`translate_batch(..., use_vmap=True)`): a line of `always` under
    the empty key, then `source token<TAB>target tokens` for each source token with candidates; `tokens[i]` is id i's
    token. CTranslate2 adds its unknown, start and end tokens itself."""
    lines = ["\t" + " ".join(tokens[i] for i in shortlist.always.tolist())]
    for source, row in enumerate(shortlist.candidates.tolist()):
        listed = [tokens[i] for i in row if i >= 0]
        if listed:
            lines.append(f"{tokens[source]}\t{' '.join(listed)}")
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
