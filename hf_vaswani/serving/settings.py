"""The settings of `vaswani serve`: how requests are batched, how much may wait, and the limits on a request."""

from dataclasses import dataclass, field, fields

from ..model.errors_vaswani import UsageError


def setting(default: int | float, help: str) -> int | float:
    """A field with the help of its command-line option."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServingSettings:
    """One `vaswani serve` option each (`--max-batch-sentences` for `max_batch_sentences`), checked on construction."""

    max_batch_sentences: int = setting(64, "sentences decoded together, at most")
    max_batch_tokens: int = setting(
        4096, "source tokens of a batch, padding included (sentences x the longest), at most; a longer sentence alone"
    )
    # Measured at concurrency 16 with single-sentence requests: throughput alike from 0 to 20 ms for a base-size model
    # (a batch decodes long enough for requests to gather meanwhile), lower from 10 ms for a small one; 2 ms still
    # gathers requests sent together, at little cost to a request that comes alone.
    batch_wait_ms: float = setting(2.0, "how long a sentence waits for others to fill its batch, at most (ms)")
    max_queued_sentences: int = setting(
        1024, "sentences waiting for a batch, at most: a request that would exceed it gets 503 with Retry-After"
    )
    max_characters: int = setting(2000, "characters of a sentence (a line of a text), at most: 400 above")
    max_sentences: int = setting(256, "sentences of a request (the lines of all its texts), at most: 400 above")
    max_body_bytes: int = setting(1 << 20, "bytes of a request body, at most: 413 above")
    max_alternatives: int = setting(4, "alternatives a request may ask for (an n-best list one longer), at most")

    def __post_init__(self) -> None:
        for name in (setting.name for setting in fields(self)):
            value, least = getattr(self, name), 0 if name in ("batch_wait_ms", "max_alternatives") else 1
            if value < least:
                raise UsageError(f"{option(name)} must be at least {least}, got {value}")
        if self.max_queued_sentences < self.max_sentences:
            raise UsageError(
                f"{option('max_queued_sentences')} {self.max_queued_sentences} is below {option('max_sentences')} "
                f"{self.max_sentences}: a request of the largest size could never be queued"
            )


def option(name: str) -> str:
    """The command-line option of the setting `name`."""
    return "--" + name.replace("_", "-")
