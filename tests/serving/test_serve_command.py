"""The `vaswani serve` command: what it refuses before loading anything (one line, exit code 2), the model's languages
from its folder, and the server as a process of its own on 127.0.0.1: SIGTERM with requests in flight, a log line a
request, and its memory over 2,000 requests."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import refused

from hf_vaswani import UsageError
from hf_vaswani.serving.languages import LanguagePair, language_pair

TIMEOUT = 60.0  # seconds, any request or wait of these tests (the process imports torch and loads the model first)
LANGUAGES = ["--source-lang", "en", "--target-lang", "de"]
# RSS may grow this much from after the first 100 requests to after 2,000. It settles within about 1.5 MiB (allocator
# pools, batch shapes seen for the first time); a request's body, job or response kept (2 KB a request) would pass it.
RSS_GROWTH_BOUND = 4 * 2**20


def model_card(folder: Path, *languages: str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "README.md").write_text("---\nlanguage:\n" + "".join(f"- {code}\n" for code in languages) + "---\n")
    return folder


def test_the_languages_come_from_the_model_card_or_the_options(tmp_path) -> None:
    card = model_card(tmp_path / "card", "en", "de")
    assert language_pair(card, None, None) == language_pair(card, "en", "de") == LanguagePair("en", "de")
    with pytest.raises(UsageError, match="--source-lang fr: .* translates en to de, as its model card says"):
        language_pair(card, "fr", None)
    assert language_pair(tmp_path, "fr", "en") == LanguagePair("fr", "en")  # a folder without a card
    assert language_pair(model_card(tmp_path / "three", "en", "de", "fr"), "en", "de") == LanguagePair("en", "de")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ([], "does not record its languages (a model card listing them): give --source-lang and --target-lang"),
        (["--source-lang", "en"], "give --source-lang and --target-lang"),
        (["--source-lang", "auto", "--target-lang", "de"], "'auto' is a request's word"),
        ([*LANGUAGES, "--max-batch-sentences", "0"], "--max-batch-sentences must be at least 1, got 0"),
        ([*LANGUAGES, "--batch-wait-ms", "-1"], "--batch-wait-ms must be at least 0"),
        ([*LANGUAGES, "--max-sentences", "20", "--max-queued-sentences", "10"], "could never be queued"),
        ([*LANGUAGES, "--port", "70000"], "--port must be from 0 to 65535"),
        ([*LANGUAGES, "--shortlist"], "has no shortlist"),
    ],
)
def test_bad_options_are_refused_before_loading(capsys, tmp_path, options: list[str], named: str) -> None:
    refused(capsys, ["serve", str(tmp_path), *options], named)  # tmp_path holds no model: nothing was loaded


def test_a_port_in_use_is_refused_before_loading(capsys, tmp_path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        refused(
            capsys, ["serve", str(tmp_path), *LANGUAGES, "--port", str(port)], f"cannot listen on 127.0.0.1 port {port}"
        )


@pytest.mark.parametrize("package", ["starlette", "uvicorn", "python_multipart"])
def test_without_the_serving_packages_the_command_says_what_to_install(
    capsys, monkeypatch, tmp_path, package: str
) -> None:
    # `import package` fails, as where it is not installed; the serving modules that import it are imported again
    importing = [f"hf_vaswani.serving.{module}" for module in ("app", "batcher", "libretranslate", "server")]
    for module in [name for name in sys.modules if name.startswith(f"{package}.")] + importing:
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, package, None)
    argv = ["serve", str(tmp_path), *LANGUAGES, "--port", "0"]
    refused(capsys, argv, f"serving needs {package}, not installed: pip install 'hf_vaswani[serve]'")


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    stdout: Path


@contextmanager
def server_process(folder: Path, workdir: Path, *options: str) -> Iterator[ServerProcess]:
    """`vaswani serve FOLDER` on 127.0.0.1 on a free port, its output in files (never a pipe that fills up), until it
    answers /health; killed at the end of the block if still running."""
    stdout, stderr = workdir / "stdout.txt", workdir / "stderr.txt"
    command = [sys.executable, "-m", "hf_vaswani.cli", "serve", str(folder), "--port", "0", *LANGUAGES, *options]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(stdout, "w") as out, open(stderr, "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=environment)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (listening := re.search(r"serving on (http://127\.0\.0\.1:\d+)", stderr.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.05)
        url = listening.group(1)
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        yield ServerProcess(url, process, stdout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)


def translate(url: str, sentence: str, client: httpx.Client | None = None) -> httpx.Response:
    body = {"q": sentence, "source": "en", "target": "de"}
    return (client or httpx).post(f"{url}/translate", json=body, timeout=TIMEOUT)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_signal_finishes_the_requests_in_flight_and_exits_0(
    trained_folder, reference, tmp_path, stop: signal.Signals
) -> None:
    # Each request waits up to 2 s for others to fill its batch: the signal comes while all four wait in the queue.
    with (
        server_process(trained_folder, tmp_path, "--batch-wait-ms", "2000") as server,
        ThreadPoolExecutor(4) as pool,
    ):
        in_flight = [pool.submit(translate, server.url, sentence) for sentence in reference.sentences[:4]]
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(f"{server.url}/health", timeout=TIMEOUT).json()["queued_sentences"] < 4:
            assert time.monotonic() < deadline
        server.process.send_signal(stop)
        while True:  # it stops accepting connections: refused, or (accepted as the listener closed) closed unanswered
            try:
                httpx.get(f"{server.url}/health", timeout=TIMEOUT)
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                break
            assert time.monotonic() < deadline
        assert server.process.wait(TIMEOUT) == 0
        assert [future.result().json() for future in in_flight] == [
            {"translatedText": text} for text in reference.best[:4]
        ]
    lines = [line for line in server.stdout.read_text().splitlines() if '"POST /translate"' in line]
    assert len(lines) == 4 and all(
        re.search(r'"POST /translate" 200 sentences=1 queue_wait=\d+\.\dms decode=\d+\.\dms', line) for line in lines
    ), lines


def test_2000_requests_leave_the_memory_within_its_bound(trained_folder, reference, tmp_path) -> None:
    clients = 8

    def send(requests: int) -> None:
        def client(first: int) -> list[str]:
            with httpx.Client() as session:
                return [
                    translate(server.url, reference.sentences[i % len(reference.sentences)], session).json()[
                        "translatedText"
                    ]
                    for i in range(first, requests, clients)
                ]

        with ThreadPoolExecutor(clients) as pool:
            for first, texts in zip(range(clients), pool.map(client, range(clients)), strict=True):
                assert texts == [reference.best[i % len(reference.best)] for i in range(first, requests, clients)]

    with server_process(trained_folder, tmp_path) as server:
        memory = psutil.Process(server.process.pid)
        send(100)
        after_100 = memory.memory_info().rss
        send(1900)
        growth = memory.memory_info().rss - after_100
    assert growth <= RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB over 1,900 requests"
