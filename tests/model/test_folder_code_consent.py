"""No `vaswani` command runs code shipped in a folder it reads, even when "y" answers transformers' question on stdin:
every loading path passes trust_remote_code explicitly (False unless --trust-remote-code is given)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PAYLOAD = """from pathlib import Path

Path(__file__).resolve().parent.parent.joinpath("payload_ran").write_text("ran")
"""

COMMANDS = {
    "translate": ["translate", "{folder}", "--input", "{text}", "--output", "{out}/translation.txt"],
    "evaluate": ["evaluate", "{folder}", "--source", "{text}", "--reference", "{text}"],
    "score": ["score", "{folder}", "--source", "{text}", "--target", "{text}"],
    "plot-attention": ["plot-attention", "{folder}", "--sentence", "a b", "--output-dir", "{out}/plots"],
    "export": ["export", "--to", "ctranslate2", "{folder}", "{out}/ct2"],
    "convert": ["convert", "--from", "marian", "{folder}", "{out}/converted"],
    "average": ["average", "{folder}", "--output", "{out}/averaged"],
    "push": ["push", "{folder}", "someone/model"],
}


def folder_with_code(root: Path) -> Path:
    """A model folder whose config and tokenizer config name code of the folder's own (auto_map)."""
    folder = root / "model"
    folder.mkdir()
    config = {"model_type": "payload", "auto_map": {"AutoConfig": "payload.PayloadConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = {"auto_map": {"AutoTokenizer": ["payload.PayloadTokenizer", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (folder / "payload.py").write_text(PAYLOAD)
    return folder


@pytest.mark.parametrize("command", COMMANDS)
def test_a_yes_on_stdin_runs_no_code_of_the_folder(command: str, tmp_path: Path) -> None:
    folder = folder_with_code(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("a b\n")
    argv = [part.format(folder=folder, text=text, out=tmp_path) for part in COMMANDS[command]]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-m", "hf_vaswani.cli", *argv],
        input="y\n" * 4,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert not (tmp_path / "payload_ran").exists(), f"vaswani {command} ran the folder's code:\n{result.stderr}"
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"vaswani {command}: error:"), result.stderr
