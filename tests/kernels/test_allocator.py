"""reuse_freed_memory: a loop freeing and allocating the same large tensors stops page-faulting (the kernel's count)."""

import platform
import subprocess
import sys

import pytest

from hf_vaswani import cli

# Each round allocates a 64 MiB tensor (above glibc's largest adaptive mmap threshold, 32 MiB) and a 16 MiB product,
# then frees both; the page faults of the last 20 of 40 rounds are summed from getrusage, in a process of their own
# since the setting is process-wide.
LOOP = """
import resource, sys, torch
from hf_vaswani.kernels.allocator import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
weight = torch.randn(4096, 1024)
faults = []
for _ in range(40):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gradient = torch.zeros(16 * 2**20)
    scores = weight * 2 + 1
    gradient[: scores.numel()] += scores.flatten()
    del gradient, scores
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[20:]))
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's"
)


def steady_faults(mode: str) -> int:
    completed = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, check=True)
    return int(completed.stdout.split()[-1])


@glibc
def test_freed_memory_is_reused_without_page_faults():
    pages_per_round = (16 + 64) * 2**20 // 4096
    default, reused = steady_faults("default"), steady_faults("reuse")
    # glibc's defaults map fresh pages every round: about one fault per 4 KiB page touched, unless the kernel backs them
    # with transparent huge pages (one fault per 2 MiB), and then there is nothing to count
    if default < 20 * pages_per_round * 0.6:
        pytest.skip(f"{default} page faults in 20 rounds with glibc's defaults: not one per 4 KiB page here")
    # kept memory: an occasional round still grows the heap (memalign's alignment slack), far from a fault per page
    assert reused < default / 4


@glibc
def test_vaswani_console_script_reuses_freed_memory_python_callers_keep_theirs(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli, "reuse_freed_memory", lambda: calls.append(True))
    command = ["average", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        cli.main(command)  # called from Python: the caller's process, the caller's allocator
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["vaswani", *command])
    with pytest.raises(SystemExit):
        cli.main()  # the console script: `vaswani = "hf_vaswani.cli:main"` calls it without arguments
    assert calls == [True]
