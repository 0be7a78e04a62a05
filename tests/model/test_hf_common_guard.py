"""Where transformers' common model tests are missing, test_hf_common.py skips with the reason, and fails under CI."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pytest import ExitCode

HF_COMMON = Path(__file__).with_name("test_hf_common.py")


def run_without_shared(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """pytest on a copy of test_hf_common.py in a checkout with no ../shared beside it, CI set to `ci` or unset."""
    copy = tmp_path / "checkout" / "tests" / "model" / HF_COMMON.name
    copy.parent.mkdir(parents=True)
    shutil.copy(HF_COMMON, copy)
    env = {name: value for name, value in os.environ.items() if name != "CI"} | ({"CI": ci} if ci is not None else {})
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", str(copy)]
    return subprocess.run(command, cwd=copy.parent, env=env, capture_output=True, text=True, timeout=300)


def test_missing_common_tests_fail_under_ci(tmp_path: Path) -> None:
    result = run_without_shared(tmp_path, "true")  # as .ci/run is run: CI=true bash .ci/run
    missing = tmp_path.resolve() / "shared" / "hf_common_tests"
    assert result.returncode not in (ExitCode.OK, ExitCode.NO_TESTS_COLLECTED), result.stdout[-3000:]
    assert f"transformers' common model tests are not at {missing}; CI runs" in result.stdout, result.stdout[-3000:]


def test_missing_common_tests_skip_with_the_reason_elsewhere(tmp_path: Path) -> None:
    result = run_without_shared(tmp_path, None)
    missing = tmp_path.resolve() / "shared" / "hf_common_tests"
    assert result.returncode == ExitCode.NO_TESTS_COLLECTED, result.stdout[-3000:]  # the whole file skipped
    assert "SKIPPED [1] " in result.stdout and f"are not at {missing}" in result.stdout, result.stdout[-3000:]
