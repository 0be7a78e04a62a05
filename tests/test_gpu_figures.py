"""scripts/gpu_figures.py at tiny sizes on the CPU: every section measured or skipped with its reason, its checks
holding, its time limit kept; and its two-process step under gloo, the one run of that code short of 2+ GPUs."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
SECTIONS = ["correctness", "training", "generation", "multi30k", "distributed"]


def gpu_figures(output_dir: Path, *options: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_figures.py"), "--tiny", "--output-dir", str(output_dir), *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output_dir / "gpu_figures.json").read_text())


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> tuple[dict, Path]:
    output_dir = tmp_path_factory.mktemp("gpu_figures")
    return gpu_figures(output_dir, "--time-limit", "10"), output_dir


def test_every_section_is_measured_or_skipped_with_its_reason(tiny_report) -> None:
    report, output_dir = tiny_report
    assert list(report["sections"]) == SECTIONS
    sections = report["sections"]
    for name in ("correctness", "training", "generation"):
        assert sections[name]["status"] == "measured", sections[name]
        for item, outcome in sections[name]["results"].items():
            assert "error" not in outcome, (item, outcome)
            assert "skipped" not in outcome or outcome["skipped"], item
    assert sections["multi30k"] == {"status": "skipped", "reason": "no --multi30k DIR given", "seconds": 0.0}
    assert sections["distributed"]["status"] == "skipped"
    assert sections["distributed"]["reason"].startswith("no CUDA device")
    markdown = (output_dir / "gpu_figures.md").read_text()
    assert markdown.startswith("# GPU figures")
    assert all(f"## {name} (" in markdown for name in SECTIONS)


def test_the_checks_hold_on_the_cpu(tiny_report) -> None:
    report, _ = tiny_report
    correctness = report["sections"]["correctness"]["results"]
    assert correctness["reverse task: training until greedy is exact on the CPU"]["greedy exact on CPU"] == 1.0
    decoding = correctness["reverse task: device decoding = CPU fp32"]
    assert decoding["beam 1 fp32 = CPU fp32"] and decoding["beam 4 fp32 = CPU fp32"]
    assert correctness["reverse task: static cache + compiled = eager"]["beam 4 fp32 equal"]
    if report["bf16"]:
        assert correctness["attention implementations, bf16 logits"]["sdpa within tolerance"]
        assert correctness["Trainer step: bf16 loss = fp32 loss"]["within tolerance"]
    training = report["sections"]["training"]["results"]
    assert set(training) == {"base, hf_vaswani", "base, MarianMT", "big, hf_vaswani", "big, MarianMT"}
    assert all(outcome["MFU %"] == "n/a" for outcome in training.values())  # no GPU peak to divide by
    generation = report["sections"]["generation"]["results"]
    assert generation["greedy, batch 4, hf_vaswani eager"]["output length"] == 6  # forced
    assert generation["beam 4, batch 4, MarianMT eager"]["output length"] == 6


def test_nothing_starts_past_the_time_limit(tmp_path) -> None:
    started = time.monotonic()
    report = gpu_figures(tmp_path, "--time-limit", "0")
    for section in report["sections"].values():
        assert section == {"status": "skipped", "reason": "time limit reached before this section"}
    assert report["elapsed_seconds"] < 5
    assert time.monotonic() - started < 120  # imports and the bf16 probe, nothing measured


def test_a_measurement_without_the_time_it_needs_is_skipped(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import gpu_figures as script

    cpu = script.torch.device("cpu")
    header = {"device": script.device_description(cpu), "bf16": False, "tiny": False, "time_limit_minutes": 0.5}
    run = script.Run(cpu, script.FULL, False, time.monotonic() + 30, script.Report(tmp_path, header))
    section = script.Section(run, {})
    section.measure("quick", 10, lambda: {"value": 1})
    section.measure("slow", 60, lambda: pytest.fail("measured without the time it needs"))
    section.measure("broken", 1, lambda: 1 / 0)
    assert section.results["quick"]["value"] == 1
    assert section.results["slow"]["skipped"].startswith("time limit:")
    assert section.results["broken"]["error"] == "ZeroDivisionError: division by zero"


def test_two_processes_step_as_one_process_with_the_whole_batch(monkeypatch) -> None:
    """FSDP2, sharded per layer; DDP differs by one line (the wrapper) and costs as much to start."""
    monkeypatch.syspath_prepend(str(SCRIPTS))  # spawn's processes import the script by name, as this one does
    import gpu_figures as script

    outcome = script.two_process_step("FSDP", "gloo", script.TINY)
    assert outcome["equal (1e-3 of the update)"], outcome
