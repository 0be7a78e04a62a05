"""Shared test helpers."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REFUSE_HF_VASWANI = """
import sys


class RefuseHfVaswani:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_vaswani":
            raise ImportError("hf_vaswani is deliberately not importable here")


sys.meta_path.insert(0, RefuseHfVaswani())
"""


def run_without_hf_vaswani(script: str, args: list[str], workdir: Path) -> dict:
    """Run `script` in a fresh interpreter that cannot import hf_vaswani (as on a machine without it), offline.

    Returns the JSON object that the script prints on its last line.
    """
    path = workdir / "without_hf_vaswani.py"
    path.write_text(REFUSE_HF_VASWANI + textwrap.dedent(script))
    env = {**os.environ, "HF_HOME": str(workdir / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, str(path), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {result.stderr[-3000:]}"
    return json.loads(lines[-1])
