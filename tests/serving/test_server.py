"""`vaswani serve`'s application on a real uvicorn server on 127.0.0.1, in a thread of the test process: LibreTranslate
requests answered as `vaswani translate` answers them, concurrent requests batched, bad input and a full queue refused
with their status and a JSON error, a request that goes away dropped, and the server serving on after each.

Decoding is held back, where a test needs it, by a gate the test opens (`GatedTranslator`), never by sleeping: every
wait is bounded in time and every request has a timeout.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from hf_vaswani import Translator
from hf_vaswani.serving.app import create_app
from hf_vaswani.serving.batcher import Batcher
from hf_vaswani.serving.languages import LanguagePair
from hf_vaswani.serving.server import listening_socket, uvicorn_server
from hf_vaswani.serving.settings import ServingSettings

PAIR = LanguagePair("en", "de")
TIMEOUT = 30.0  # seconds, any request or wait of these tests


def waited_for(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds, for at most TIMEOUT seconds."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"waited {TIMEOUT} s for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def translator(trained_folder) -> Iterator[Translator]:
    with Translator(trained_folder) as engine:
        yield engine


class GatedTranslator:
    """The engine, each decoding call recorded and held until the test opens `gate` (open from the start unless
    `held`); a sentence equal to BUG raises, as a bug in decoding would."""

    BUG = "a sentence that a bug fails on"

    def __init__(self, translator: Translator, held: bool = False):
        self.translator = translator
        self.tokenizer = translator.tokenizer
        self.gate = threading.Event()
        if not held:
            self.gate.set()
        self.calls: list[list[str]] = []

    def _held(self, sentences: list[str]) -> None:
        self.calls.append(list(sentences))
        assert self.gate.wait(TIMEOUT)
        if self.BUG in sentences:
            raise RuntimeError("the bug of GatedTranslator")

    def translate(self, sentences: list[str], batch_size: int = 64) -> list[str]:
        self._held(sentences)
        return self.translator.translate(sentences, batch_size=batch_size)

    def translate_nbest(self, sentences: list[str], k: int, batch_size: int = 64) -> list:
        self._held(sentences)
        return self.translator.translate_nbest(sentences, k, batch_size=batch_size)


@dataclass
class Server:
    url: str
    batcher: Batcher
    decoding: GatedTranslator

    def post(self, client: httpx.Client | None = None, **request) -> httpx.Response:
        return (client or httpx).post(f"{self.url}/translate", timeout=TIMEOUT, **request)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=TIMEOUT)


@contextmanager
def serving(translator: Translator, held: bool = False, **settings) -> Iterator[Server]:
    """The application on uvicorn on 127.0.0.1 (a free port), in a thread, until the block ends."""
    decoding = GatedTranslator(translator, held)
    settings = ServingSettings(**settings)
    batcher = Batcher(decoding, settings)
    listening = listening_socket("127.0.0.1", 0)
    server = uvicorn_server(create_app(batcher, PAIR, settings), listening)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        waited_for(lambda: server.started, "the server to start")
        yield Server(f"http://127.0.0.1:{listening.getsockname()[1]}", batcher, decoding)
    finally:
        decoding.gate.set()
        server.should_exit = True
        thread.join(TIMEOUT)
        assert not thread.is_alive()


def request(q: str | list[str], **fields) -> dict:
    return {"q": q, "source": "en", "target": "de", **fields}


def test_json_and_form_posts_translate_as_the_command(translator, reference) -> None:
    sentences, best, nbest = reference.sentences, reference.best, reference.nbest
    with serving(translator) as server:
        response = server.post(json=request(sentences))
        assert response.status_code == 200 and response.json() == {"translatedText": best}
        for sentence, expected in list(zip(sentences, best, strict=True))[:4]:
            # form-encoded (curl -d, LibreTranslate's Python bindings) and multipart (its web page's FormData)
            assert server.post(data=request(sentence)).json() == {"translatedText": expected}
            assert server.post(files={name: (None, value) for name, value in request(sentence).items()}).json() == {
                "translatedText": expected
            }
        form_list = server.post(data=request(sentences[:3]))  # q=...&q=...&q=...: a list
        assert form_list.json() == {"translatedText": best[:3]}
        # a text's lines are sentences; blank lines stay blank
        text = f"{sentences[0]}\n\n{sentences[1]}\r\n{sentences[2]}"
        assert server.post(json=request(text)).json() == {"translatedText": f"{best[0]}\n\n{best[1]}\n{best[2]}"}
        auto = server.post(json=request(sentences[:2], source="auto")).json()
        assert auto["translatedText"] == best[:2]
        assert auto["detectedLanguage"] == [{"confidence": 100.0, "language": "en"}] * 2
        alternatives = server.post(
            json=request(sentences, alternatives=reference.nbest_size - 1, api_key="ignored")
        ).json()
        assert alternatives["translatedText"] == [hypotheses[0] for hypotheses in nbest]
        assert alternatives["alternatives"] == [
            list(dict.fromkeys(text for text in hypotheses[1:] if text != hypotheses[0])) for hypotheses in nbest
        ]
        one = server.post(data=request(sentences[0], alternatives=str(reference.nbest_size - 1))).json()
        assert one["translatedText"] == nbest[0][0] and isinstance(one["alternatives"], list)


def test_languages_and_health(translator) -> None:
    with serving(translator) as server:
        assert server.get("/languages").json() == [
            {"code": "en", "name": "English", "targets": ["de"]},
            {"code": "de", "name": "German", "targets": []},
        ]
        assert server.get("/health").json() == {"status": "ok", "queued_sentences": 0}


def test_concurrent_clients_get_the_sequential_outputs(translator, reference) -> None:
    sentences, best = reference.sentences, reference.best
    clients = 16
    with serving(translator, held=True) as server, ThreadPoolExecutor(clients) as pool:
        # Round 1: the first batch held until every client's sentence has arrived; the others then decode together.
        round_one = [pool.submit(server.post, json=request(sentences[i])) for i in range(clients)]
        waited_for(
            lambda: server.decoding.calls and server.batcher.queued_sentences + len(server.decoding.calls[0]) == 16,
            "every request to arrive",
        )
        server.decoding.gate.set()
        assert [future.result().json()["translatedText"] for future in round_one] == best[:clients]
        assert sorted(sentence for call in server.decoding.calls for sentence in call) == sorted(sentences[:clients])
        assert len(server.decoding.calls) <= 2  # the held batch, then all the others together

        # Round 2: each client sends its sentences one request at a time, as fast as it gets answers.
        def client(first: int) -> list[str]:
            with httpx.Client() as session:
                return [
                    server.post(session, json=request(sentences[i % len(sentences)])).json()["translatedText"]
                    for i in range(first, first + 4)
                ]

        answers = list(pool.map(client, range(clients)))
    assert answers == [[best[i % len(best)] for i in range(first, first + 4)] for first in range(clients)]


def test_a_long_list_is_cut_into_bounded_batches(translator, reference) -> None:
    sentences, best = reference.sentences, reference.best
    limits = dict(max_batch_sentences=5, max_batch_tokens=60)
    with serving(translator, **limits) as server:
        assert server.post(json=request(sentences)).json() == {"translatedText": best}
    tokens = {
        sentence: len(ids)
        for sentence, ids in zip(sentences, translator.tokenizer(sentences)["input_ids"], strict=True)
    }
    assert sorted(sentence for call in server.decoding.calls for sentence in call) == sorted(sentences)
    for call in server.decoding.calls:
        assert len(call) <= 5
        assert len(call) == 1 or len(call) * max(tokens[sentence] for sentence in call) <= 60


BAD_REQUESTS = {
    "malformed JSON": (400, dict(content=b'{"q": "a', headers={"content-type": "application/json"}), "not valid JSON"),
    "JSON not an object": (400, dict(json=["a"]), "object"),
    "missing q": (400, dict(json={"source": "en", "target": "de"}), "missing q"),
    "empty q": (400, dict(data={"q": "", "source": "en", "target": "de"}), "missing q"),
    "missing target": (400, dict(json={"q": "a", "source": "en"}), "missing target"),
    "q a number": (400, dict(json=request(5)), "q must be"),
    "q a list with a number": (400, dict(json=request(["a", 5])), "q must be"),
    "unknown source": (400, dict(json=request("a", source="fr")), "source language fr"),
    "unknown target": (400, dict(json=request("a", target="fr")), "target language fr"),
    "html": (400, dict(json=request("a", format="html")), "format html"),
    "alternatives negative": (400, dict(json=request("a", alternatives=-1)), "alternatives"),
    "alternatives a word": (400, dict(data=request("a", alternatives="many")), "alternatives"),
    "alternatives over the limit": (400, dict(json=request("a", alternatives=9)), "alternatives"),
    "JSON not UTF-8": (400, dict(content=b'{"q": "\xff"}', headers={"content-type": "application/json"}), "UTF-8"),
    "form not UTF-8": (
        400,
        dict(content=b"q=%FF&source=en&target=de", headers={"content-type": "application/x-www-form-urlencoded"}),
        "UTF-8",
    ),
    "multipart not UTF-8": (
        400,
        dict(files={"q": (None, b"\xff"), "source": (None, "en"), "target": (None, "de")}),
        "UTF-8",
    ),
    "a body of plain text": (400, dict(content=b"a", headers={"content-type": "text/plain"}), "text/plain"),
    "too many sentences": (400, dict(json=request(["a"] * 5)), "5 sentences"),
    "too many lines": (400, dict(json=request("a\nb\nc\nd\ne")), "5 sentences"),
    "too many characters": (400, dict(json=request("a" * 41)), "41 characters"),
    "body too large": (413, dict(json=request("a" * 30, api_key="k" * 600)), "limit of 512"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_gets_its_status_and_a_json_error_and_the_server_serves_on(translator, reference, case: str) -> None:
    status, sent, named = BAD_REQUESTS[case]
    sentences, best = reference.sentences, reference.best
    with serving(translator, max_sentences=4, max_characters=40, max_body_bytes=512, max_alternatives=3) as server:
        response = server.post(**sent)
        assert response.status_code == status and named in response.json()["error"], response.text
        assert "\n" not in response.json()["error"]
        assert server.post(json=request(sentences[0])).json() == {"translatedText": best[0]}
    assert server.decoding.calls == [[sentences[0]]]  # nothing refused was decoded


def test_wrong_methods_and_paths_get_json_errors(translator) -> None:
    with serving(translator) as server:
        assert (server.get("/translate").status_code, server.get("/translate").json()) == (
            405,
            {"error": "Method Not Allowed"},
        )
        assert (server.get("/nowhere").status_code, server.get("/nowhere").json()) == (404, {"error": "Not Found"})


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_bug_is_a_500_with_its_traceback_logged_and_the_server_serves_on(translator, reference) -> None:
    sentences, best = reference.sentences, reference.best
    with serving(translator) as server:
        logged = Records()
        logging.getLogger("uvicorn.error").addHandler(logged)
        try:
            response = server.post(json=request(GatedTranslator.BUG))
            # uvicorn logs what the application raised once the response has gone
            waited_for(lambda: any(record.exc_info for record in logged.records), "the traceback to be logged")
        finally:
            logging.getLogger("uvicorn.error").removeHandler(logged)
        assert response.status_code == 500 and "RuntimeError" in response.json()["error"]
        failures = [record.exc_info[1] for record in logged.records if record.exc_info]
        assert [str(failure) for failure in failures] == ["the bug of GatedTranslator"]
        assert failures[0].__traceback__ is not None
        assert server.post(json=request(sentences[0])).json() == {"translatedText": best[0]}


def test_a_full_queue_gets_503_with_retry_after(translator, reference) -> None:
    sentences, best = reference.sentences, reference.best
    with (
        serving(translator, held=True, max_queued_sentences=2, max_sentences=2) as server,
        ThreadPoolExecutor(2) as pool,
    ):
        decoding = pool.submit(server.post, json=request(sentences[0]))
        waited_for(lambda: server.decoding.calls, "the first batch")  # held at the gate, out of the queue
        queued = pool.submit(server.post, json=request(sentences[1:3]))
        waited_for(lambda: server.batcher.queued_sentences == 2, "the queue to fill")
        refused = server.post(json=request(sentences[3]))
        assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
        assert "busy" in refused.json()["error"]
        server.decoding.gate.set()
        assert decoding.result().json() == {"translatedText": best[0]}
        assert queued.result().json() == {"translatedText": best[1:3]}
        assert server.post(json=request(sentences[3])).json() == {"translatedText": best[3]}


def test_a_request_that_goes_away_costs_nothing_further(translator, reference) -> None:
    sentences, best = reference.sentences, reference.best
    with serving(translator, held=True, max_batch_sentences=2, batch_wait_ms=0) as server:
        with ThreadPoolExecutor(1) as pool:
            # the client gives up after a second: its first batch of 2 is held, 4 sentences wait in the queue
            impatient = pool.submit(httpx.post, f"{server.url}/translate", json=request(sentences[:6]), timeout=1.0)
            waited_for(lambda: server.decoding.calls, "the first batch")
            with pytest.raises(httpx.TimeoutException):
                impatient.result()
        waited_for(lambda: server.batcher.queued_sentences == 0, "the queued sentences to be dropped")
        server.decoding.gate.set()
        assert server.post(json=request(sentences[6])).json() == {"translatedText": best[6]}
    first, *others = server.decoding.calls
    assert len(first) == 2 and set(first) <= set(sentences[:6]) and others == [[sentences[6]]]
