"""Sentences of concurrent requests decoded in shared batches, on a worker thread of their own.

A request's sentences join a queue bounded in sentences (`QueueFull` past it). The worker takes the oldest sentence's
group (requests asking for the same n-best size decode together), waits for the group to fill a batch, at most the
batching wait after that sentence arrived, and decodes up to the batch's bounds in sentences and in padded source
tokens. A request's own sentences queue sorted by length, so that a long list is cut into batches of similar lengths
like everyone else's. A request whose caller stops waiting (cancelled, disconnected) is withdrawn: its sentences still
queued are dropped, and a batch already decoding them finishes without it.
"""

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from ..decoding.translation import Hypothesis
from .settings import ServingSettings


class SentenceTranslator(Protocol):
    """What the batcher decodes with: `hf_vaswani.Translator`."""

    tokenizer: PreTrainedTokenizerBase

    def translate(self, sentences: Sequence[str], batch_size: int = ...) -> list[str]: ...

    def translate_nbest(self, sentences: Sequence[str], k: int, batch_size: int = ...) -> list[list[Hypothesis]]: ...


class QueueFull(Exception):
    """The queue cannot take a request's sentences now (or the server is stopping): the client should retry later."""


@dataclass(frozen=True)
class Decoded:
    """A request's translations: each sentence's n-best texts, best first (one text without alternatives); the
    seconds its first sentence waited for a batch, and the seconds of the batches that decoded its sentences."""

    texts: list[list[str]]
    queue_seconds: float
    decode_seconds: float


@dataclass(eq=False)
class Job:
    """One request's sentences on their way through the queue."""

    sentences: list[str]
    nbest: int
    future: asyncio.Future
    submitted: float = field(default_factory=time.perf_counter)
    texts: list[list[str] | None] = field(init=False)
    queued: int = field(init=False)  # sentences not yet taken into a batch
    unfinished: int = field(init=False)
    started: float | None = None
    decode_seconds: float = 0.0
    withdrawn: bool = False

    def __post_init__(self) -> None:
        self.texts = [None] * len(self.sentences)
        self.queued = self.unfinished = len(self.sentences)


@dataclass(frozen=True)
class Item:
    """A queued sentence: its request, its place there, its source tokens."""

    job: Job
    index: int
    tokens: int


def settle(future: asyncio.Future, result: object = None, error: BaseException | None = None) -> None:
    """Complete `future` in its event loop, unless its waiter has gone (cancelled)."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class Batcher:
    """The queue and its worker thread: `start()` in the event loop, `await translate(...)` from requests,
    `await stop()` to decode what is queued and end the worker."""

    def __init__(self, translator: SentenceTranslator, settings: ServingSettings):
        self.translator = translator
        self.settings = settings
        self._changed = threading.Condition()
        self._arrivals: list[Job] = []  # submitted, not yet tokenized
        self._groups: dict[int, deque[Item]] = {}  # by n-best size, in arrival order
        self._queued = 0  # sentences of _arrivals and _groups
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker = threading.Thread(target=self._work, name="hf_vaswani-batcher", daemon=True)

    @property
    def queued_sentences(self) -> int:
        return self._queued

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._worker.start()

    async def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()
        await asyncio.to_thread(self._worker.join)

    async def translate(self, sentences: list[str], nbest: int = 1) -> Decoded:
        """`sentences` (none blank) decoded in the shared batches: their `nbest` best translations each. Raises
        QueueFull when the queue cannot take them; cancelling the call withdraws them."""
        if not sentences:
            return Decoded([], 0.0, 0.0)
        job = Job(sentences, nbest, self._loop.create_future())
        with self._changed:
            if self._stopping or self._queued + len(sentences) > self.settings.max_queued_sentences:
                raise QueueFull
            self._queued += len(sentences)
            self._arrivals.append(job)
            self._changed.notify()
        try:
            await job.future
        except BaseException:  # cancelled, or failed (then already withdrawn)
            self._withdraw(job)
            raise
        return Decoded(job.texts, job.started - job.submitted, job.decode_seconds)

    def _withdraw(self, job: Job) -> None:
        """Drop `job`'s sentences still queued."""
        with self._changed:
            job.withdrawn = True
            if job in self._arrivals:
                self._arrivals.remove(job)
            elif job.queued:
                for nbest, group in list(self._groups.items()):
                    kept = deque(item for item in group if item.job is not job)
                    if kept:
                        self._groups[nbest] = kept
                    else:
                        del self._groups[nbest]
            self._queued -= job.queued
            job.queued = 0

    def _work(self) -> None:
        while True:
            with self._changed:
                while True:
                    arrivals, self._arrivals = self._arrivals, []
                    if arrivals:
                        break
                    batch, wait = self._next_batch()
                    if batch:
                        break
                    if self._stopping and not self._groups:
                        return
                    self._changed.wait(wait)
            if arrivals:
                self._file(arrivals)
            else:
                self._decode(batch)

    def _file(self, jobs: list[Job]) -> None:
        """Tokenize the arrivals' sentences (here, in the thread that decodes with the same tokenizer) and queue them
        in their group, each request's sorted by length."""
        lengths = {}
        for job in jobs:
            try:
                lengths[job] = [len(ids) for ids in self.translator.tokenizer(job.sentences)["input_ids"]]
            except Exception as error:  # a bug: the request gets it, with its traceback
                self._fail(job, error)
        with self._changed:
            for job, tokens in lengths.items():
                if not job.withdrawn:
                    order = sorted(range(len(job.sentences)), key=tokens.__getitem__)
                    self._groups.setdefault(job.nbest, deque()).extend(Item(job, i, tokens[i]) for i in order)

    def _next_batch(self) -> tuple[list[Item], float | None]:
        """The batch to decode now, taken off the queue (under the lock); or none, with how long to wait for it."""
        if not self._groups:
            return [], None
        nbest = min(self._groups, key=lambda size: self._groups[size][0].job.submitted)
        group = self._groups[nbest]
        size, longest, full = 0, 0, False
        for item in group:
            if size == self.settings.max_batch_sentences or (
                size and max(longest, item.tokens) * (size + 1) > self.settings.max_batch_tokens
            ):
                full = True
                break
            size, longest = size + 1, max(longest, item.tokens)
        wait = group[0].job.submitted + self.settings.batch_wait_ms / 1000 - time.perf_counter()
        if not full and wait > 0 and not self._stopping:
            return [], wait
        batch = [group.popleft() for _ in range(size)]
        if not group:
            del self._groups[nbest]
        for item in batch:
            item.job.queued -= 1
        self._queued -= size
        return batch, None

    def _decode(self, batch: list[Item]) -> None:
        jobs = list(dict.fromkeys(item.job for item in batch))
        sentences = [item.job.sentences[item.index] for item in batch]
        nbest = batch[0].job.nbest
        started = time.perf_counter()
        try:
            if nbest == 1:
                texts = [[text] for text in self.translator.translate(sentences, batch_size=len(sentences))]
            else:
                hypotheses = self.translator.translate_nbest(sentences, nbest, batch_size=len(sentences))
                texts = [[hypothesis.text for hypothesis in sentence] for sentence in hypotheses]
        except Exception as error:  # the user's (UsageError) or a bug: each request of the batch gets it
            for job in jobs:
                self._fail(job, error)
            return
        seconds = time.perf_counter() - started
        for job in jobs:
            job.started = job.started or started
            job.decode_seconds += seconds
        for item, text in zip(batch, texts, strict=True):
            item.job.texts[item.index] = text
            item.job.unfinished -= 1
            if item.job.unfinished == 0:
                self._loop.call_soon_threadsafe(settle, item.job.future, None)

    def _fail(self, job: Job, error: Exception) -> None:
        self._withdraw(job)
        self._loop.call_soon_threadsafe(settle, job.future, None, error)
