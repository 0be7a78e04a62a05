"""scripts/gpu_figures.py (the package scripts/gpu_figures/) at tiny sizes on the CPU: every section measured or
skipped with its reason, its checks holding, its summary computed from what it recorded (each system at its best,
checked on a hand-made report too), --only and --merge, its time limit kept; the pieces that need a GPU or a long run
where they can be checked without one (cuBLAS 12 from a wheel, the published run's folder, a command stopped at its
time), and its two-process step under gloo, the one run of that code short of 2+ GPUs."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPTS = Path(__file__).parents[1] / "scripts"
SECTIONS = ["correctness", "training", "trainer", "generation", "ctranslate2", "multi30k_published", "distributed"]
CAPTURED_ON_CUDA = 'mode="reduce-overhead" captures CUDA graphs: CUDA only'
HAS_CTRANSLATE2 = importlib.util.find_spec("ctranslate2") is not None
SHAPES = [(batch, beams) for batch in (2, 4) for beams in (1, 4)]  # TINY's generation batches, greedy and beam 4


def gpu_figures(output_dir: Path, *options: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_figures.py"), "--tiny", "--output-dir", str(output_dir), *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output_dir / "gpu_figures.json").read_text())


def shape(batch: int, beams: int) -> str:
    return f"{'greedy' if beams == 1 else f'beam {beams}'}, batch {batch}"


def recorded(report: dict) -> dict:
    return {
        item: outcome for entry in report["sections"].values() for item, outcome in entry.get("results", {}).items()
    }


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    """The package, its modules imported (by cli), as the script imports them: spawn's processes import them so too."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_figures.cli

        yield gpu_figures
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> tuple[dict, Path]:
    output_dir = tmp_path_factory.mktemp("gpu_figures")
    return gpu_figures(output_dir, "--time-limit", "10"), output_dir


def test_every_section_is_measured_or_skipped_with_its_reason(tiny_report) -> None:
    report, output_dir = tiny_report
    assert list(report["sections"]) == SECTIONS
    sections = report["sections"]
    on_a_cpu = ["correctness", "training", "trainer", "generation"]
    if HAS_CTRANSLATE2:
        on_a_cpu.append("ctranslate2")
    else:
        assert sections["ctranslate2"]["reason"] == "ctranslate2 is not installed"
    for name in on_a_cpu:
        assert sections[name]["status"] == "measured", sections[name]
        assert sections[name]["device"] == "CPU"
        for item, outcome in sections[name]["results"].items():
            assert "error" not in outcome, (item, outcome)
            figures = set(outcome) - {"seconds", "skipped"}
            assert bool(figures) != bool(outcome.get("skipped")), (item, outcome)  # figures, or why there are none
    assert sections["multi30k_published"] == {
        "status": "skipped",
        "device": "CPU",
        "reason": "no --multi30k DIR given",
        "seconds": 0.0,
    }
    assert sections["distributed"]["status"] == "skipped"
    assert sections["distributed"]["reason"].startswith("no CUDA device")
    markdown = (output_dir / "gpu_figures.md").read_text()
    assert markdown.startswith("# GPU figures")
    assert "## Summary" in markdown
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
    generation = report["sections"]["generation"]["results"]
    assert generation["beam 4, batch 4, hf_vaswani package loop, eager"]["equal to the eager loop"]
    skipped = generation["beam 4, batch 4, hf_vaswani package loop, compiled"]["skipped"]
    assert skipped == "the package loop compiles its steps on an accelerator only"


def test_each_figure_is_timed_at_the_sizes_asked(tiny_report) -> None:
    report, _ = tiny_report
    sections = report["sections"]
    systems = ("hf_vaswani", "MarianMT")
    training = sections["training"]["results"]
    assert set(training) == {  # TINY compiles base only; captured is skipped off CUDA
        *(f"base, {system}, {variant}" for system in systems for variant in ("eager", "compiled", "captured")),
        *(f"big, {system}, eager" for system in systems),
    }
    for system in systems:
        assert training[f"base, {system}, captured"] == {"skipped": CAPTURED_ON_CUDA}
        assert training[f"base, {system}, compiled"]["backend"] == "aot_eager"
    for outcome in (outcome for outcome in training.values() if "skipped" not in outcome):
        assert outcome["steps timed"] == 2 and outcome["source+target tokens/s"] > 0
        assert outcome["attention"] == "sdpa"
        assert outcome["MFU %"] == "n/a"  # no GPU peak to divide by
    trainer = sections["trainer"]["results"]
    assert set(trainer) == {
        "base, VaswaniTrainer, eager",
        "big, VaswaniTrainer, eager",
        "base, VaswaniTrainer, torch_compile",
    }
    assert trainer.pop("base, VaswaniTrainer, torch_compile") == {"skipped": "Trainer's torch_compile is timed on CUDA"}
    for outcome in trainer.values():
        assert outcome["steps timed"] == 2
        assert 0 < outcome["source+target tokens/s"] <= outcome["padded source+target tokens/s"]
        assert outcome["max_tokens"] == 256
    generation = sections["generation"]["results"]
    eager = ("hf_vaswani package loop", "hf_vaswani transformers loop", "MarianMT")
    compiled = [
        f"beam 4, batch 4, {system}, {variant}" for system in eager[::2] for variant in ("compiled", "captured")
    ]
    assert set(generation) == {*(f"{shape(*each)}, {system}, eager" for each in SHAPES for system in eager), *compiled}
    measured = [outcome for outcome in generation.values() if "skipped" not in outcome]
    assert len(measured) == 13  # the captured ones skipped, and the package loop's compiled one (CPU)
    assert all(outcome["output length"] == 6 for outcome in measured)  # forced
    assert generation["beam 4, batch 4, MarianMT, captured"] == {"skipped": CAPTURED_ON_CUDA}
    if HAS_CTRANSLATE2:  # on the CPU its CPU compute types, in the child process as on CUDA
        ctranslate2 = sections["ctranslate2"]["results"]
        assert ctranslate2["child process"]["exit status"] == 0
        for compute_type in ("float32", "int8"):
            assert ctranslate2["child process"][f"loaded {compute_type}"] == "yes"
            for each in SHAPES:
                assert ctranslate2[f"{shape(*each)}, CTranslate2 {compute_type}"]["output length"] == 6


def test_the_summary_is_computed_from_the_recorded_figures(tiny_report) -> None:
    report, _ = tiny_report
    figures, summary = recorded(report), report["summary"]
    for name, entry in summary.items():
        if entry["value"] is None:
            assert entry["missing"], name
            continue
        numerator = figures[entry["of"]][entry["figure"]]
        if "over" in entry:
            assert entry["value"] == pytest.approx(numerator / figures[entry["over"]][entry["figure"]], abs=6e-4)
        else:
            assert entry["value"] == numerator
    ratio = summary["base training tokens/s, hf_vaswani / MarianMT, each at its best"]
    for side, system in (("of", "hf_vaswani"), ("over", "MarianMT")):  # the better of eager and compiled
        speeds = [figures[f"base, {system}, {mode}"]["source+target tokens/s"] for mode in ("eager", "compiled")]
        assert figures[ratio[side]]["source+target tokens/s"] == max(speeds)
    for batch in (2, 4):
        for search in ("greedy", "beam 4"):
            name = f"{search}, batch {batch} tokens/s, hf_vaswani package loop at its best"
            assert summary[f"{name} / MarianMT at its best"]["value"] > 0
            assert summary[f"{name} / transformers' loop"]["value"] > 0
            assert summary[f"{name} / CTranslate2 float16"]["missing"].startswith("no output tokens/s")  # CPU types
    assert summary["big training MFU %, hf_vaswani at its best"]["value"] is None  # "n/a" on a CPU is no figure


def test_the_summary_divides_each_systems_best_by_the_others(script) -> None:
    """A hand-made report whose winners are known: each system's fastest variant, whichever it is, and nothing from a
    skipped item or another device."""

    def training(speed: float) -> dict:
        return {"source+target tokens/s": speed, "MFU %": speed / 100}

    def decoding(speed: float) -> dict:
        return {"output tokens/s": speed}

    data = {
        "device": {"name": "GPU"},
        "sizes": {"generation batches": [32]},
        "sections": {
            "training": {
                "device": "GPU",
                "results": {
                    "base, hf_vaswani, eager": training(100),
                    "base, hf_vaswani, compiled": training(300),
                    "base, hf_vaswani, captured": {"skipped": "compiling failed"},
                    "base, MarianMT, eager": training(200),
                    "base, MarianMT, compiled": training(150),
                    "base, MarianMT, captured": training(250),
                    "big, hf_vaswani, eager": training(80),
                    "big, hf_vaswani, captured": training(120),
                },
            },
            "generation": {
                "device": "GPU",
                "results": {
                    "beam 4, batch 32, hf_vaswani package loop, eager": decoding(10),
                    "beam 4, batch 32, hf_vaswani package loop, compiled": decoding(30),
                    "beam 4, batch 32, hf_vaswani package loop, captured": decoding(60),
                    "beam 4, batch 32, hf_vaswani transformers loop, eager": decoding(20),
                    "beam 4, batch 32, MarianMT, eager": decoding(15),
                    "beam 4, batch 32, MarianMT, compiled": decoding(40),
                },
            },
            "ctranslate2": {
                "device": "another GPU",
                "results": {"beam 4, batch 32, CTranslate2 float16": decoding(90)},
            },
        },
    }
    summary = script.summary.summary(data)
    assert summary["base training tokens/s, hf_vaswani / MarianMT, each at its best"] == {
        "value": 1.2,
        "figure": "source+target tokens/s",
        "of": "base, hf_vaswani, compiled",
        "over": "base, MarianMT, captured",
    }
    assert summary["big training tokens/s, hf_vaswani / MarianMT, each at its best"]["missing"] == (
        "no source+target tokens/s for big, MarianMT, eager or big, MarianMT, compiled or big, MarianMT, captured"
    )
    assert summary["big training MFU %, hf_vaswani at its best"] == {
        "value": 1.2,
        "figure": "MFU %",
        "of": "big, hf_vaswani, captured",
    }
    assert summary["base training tokens/s, hf_vaswani, compiled / eager"]["value"] == 3.0
    assert summary["base training tokens/s, hf_vaswani, captured / eager"]["value"] is None
    assert summary["base training tokens/s, MarianMT, captured / eager"]["value"] == 1.25
    name = "beam 4, batch 32 tokens/s, hf_vaswani package loop at its best"
    assert summary[f"{name} / MarianMT at its best"] == {
        "value": 1.5,
        "figure": "output tokens/s",
        "of": "beam 4, batch 32, hf_vaswani package loop, captured",
        "over": "beam 4, batch 32, MarianMT, compiled",
    }
    assert summary[f"{name} / transformers' loop"]["value"] == 3.0
    assert summary[f"{name} / CTranslate2 float16"]["missing"] == "no output tokens/s on another GPU, not GPU"
    assert (
        summary["greedy, batch 32 tokens/s, hf_vaswani package loop at its best / MarianMT at its best"]["value"]
        is None
    )


def test_ratios_take_figures_of_one_device_only(script) -> None:
    figures = {"a": ({"tokens/s": 3.0}, "GPU 1"), "b": ({"tokens/s": 2.0}, "GPU 2"), "c": ({"tokens/s": 1.5}, "GPU 1")}
    assert script.summary.summary_entry(figures, "tokens/s", ["a"], ["b"]) == {
        "value": None,
        "missing": "no tokens/s on GPU 2, not GPU 1",
    }
    # b would be the best denominator, but it is not of a's device: c is
    assert script.summary.summary_entry(figures, "tokens/s", ["a"], ["b", "c"]) == {
        "value": 2.0,
        "figure": "tokens/s",
        "of": "a",
        "over": "c",
    }


def test_only_runs_the_sections_it_names(tmp_path) -> None:
    report = gpu_figures(tmp_path, "--only", "generation", "--only", "training", "--time-limit", "5")
    statuses = {name: entry["status"] for name, entry in report["sections"].items()}
    assert statuses == {name: "measured" if name in ("generation", "training") else "not selected" for name in SECTIONS}
    assert report["only"] == ["generation", "training"]
    assert report["summary"]["base training tokens/s, hf_vaswani / MarianMT, each at its best"]["value"] > 0
    assert "beam 4, batch 4, CTranslate2 float32" not in recorded(report)


def test_merge_takes_each_section_from_the_last_report_that_ran_it(tiny_report, tmp_path, script) -> None:
    report, output_dir = tiny_report
    later = copy.deepcopy(report)
    for name in SECTIONS:
        if name != "generation":
            later["sections"][name] = {"status": "not selected"}
    # a faster MarianMT, later: its eager item 100 times its best
    item = "beam 4, batch 4, MarianMT, eager"
    results = later["sections"]["generation"]["results"]
    results[item]["output tokens/s"] = 100 * max(
        results[f"beam 4, batch 4, MarianMT, {mode}"]["output tokens/s"] for mode in ("eager", "compiled")
    )
    (tmp_path / "later.json").write_text(json.dumps(later))
    script.cli.main(
        [
            "--merge",
            str(output_dir / "gpu_figures.json"),
            str(tmp_path / "later.json"),
            "--output-dir",
            str(tmp_path / "merged"),
        ]
    )
    merged = json.loads((tmp_path / "merged" / "gpu_figures.json").read_text())
    assert merged["sections"]["generation"] == later["sections"]["generation"]
    assert merged["sections"]["training"] == report["sections"]["training"]
    name = "beam 4, batch 4 tokens/s, hf_vaswani package loop at its best / MarianMT at its best"
    assert merged["summary"][name]["over"] == item
    assert merged["summary"][name]["value"] < report["summary"][name]["value"]
    assert merged["merged from"][1].endswith("later.json")


def test_nothing_starts_past_the_time_limit(tmp_path) -> None:
    started = time.monotonic()
    report = gpu_figures(tmp_path, "--time-limit", "0")
    for section in report["sections"].values():
        assert section == {"status": "skipped", "reason": "time limit reached before this section"}
    assert report["elapsed_seconds"] < 5
    assert time.monotonic() - started < 120  # imports and the bf16 probe, nothing measured


def test_a_measurement_without_the_time_it_needs_is_skipped(tmp_path, script) -> None:
    cpu = torch.device("cpu")
    data = {
        "device": script.device.device_description(cpu),
        "bf16": False,
        "tiny": False,
        "time_limit_minutes": 0.5,
        "sizes": {"generation batches": [32, 128]},
        "sections": {name: {"status": "not selected"} for name in SECTIONS},
    }
    report = script.report.Report(tmp_path, data, time.monotonic())
    run = script.run.Run(cpu, script.sizes.FULL, False, time.monotonic() + 30, report)
    section = script.run.Section(run, {})
    section.measure("quick", 10, lambda: {"value": 1})
    section.measure("slow", 60, lambda: pytest.fail("measured without the time it needs"))
    section.measure("broken", 1, lambda: 1 / 0)
    assert section.results["quick"]["value"] == 1
    assert section.results["slow"]["skipped"].startswith("time limit:")
    assert section.results["broken"]["error"] == "ZeroDivisionError: division by zero"


def test_the_published_run_needs_its_corpus(tmp_path, script) -> None:
    script.cli.main(
        ["--tiny", "--only", "multi30k_published", "--multi30k", str(tmp_path), "--output-dir", str(tmp_path / "out")]
    )
    report = json.loads((tmp_path / "out" / "gpu_figures.json").read_text())
    entry = report["sections"]["multi30k_published"]
    assert entry["status"] == "skipped"
    assert entry["reason"] == f"{tmp_path} lacks " + ", ".join(
        f"{split}.{lang}.gz" for split in ("train", "val", "test_2016_flickr") for lang in ("en", "de")
    )


def test_the_published_run_is_read_from_its_folder(tmp_path, script) -> None:
    """Epochs 1 and 5 from the newest checkpoint's log history (checkpoint-120 after checkpoint-24: by step), results
    where the run finished; a run stopped after epoch 2 has only epoch 1's."""
    folder = tmp_path / "run"

    def log_history(epochs: int) -> list[dict]:
        history = []
        for epoch in range(1, epochs + 1):
            step = 24 * epoch
            history.append({"loss": 5.0 / epoch, "nll_loss": 4.0 / epoch, "epoch": epoch - 0.01, "step": step})
            history.append(
                {"eval_loss": 3.0 / epoch, "eval_nll_loss": 2.0 / epoch, "epoch": epoch - 0.004, "step": step}
            )
        return history

    for step, epochs in ((24, 1), (48, 2), (120, 5)):
        checkpoint = folder / "checkpoints" / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"log_history": log_history(epochs)}))
    published_run_figures = script.multi30k_published.published_run_figures
    assert published_run_figures(folder) == {
        "log history of": "checkpoints/checkpoint-120",
        "validations": 5,
        "epoch 1 eval_loss": 3.0,
        "epoch 1 eval_nll_loss": 2.0,
        "epoch 5 eval_loss": 0.6,
        "epoch 5 eval_nll_loss": 0.4,
    }
    results = {
        "whitespace_bleu": 40.1,
        "bleu": 39.0,
        "steps": 120,
        "train_seconds": 400.0,
        "training_precision": "bf16",
    }
    (folder / "results.json").write_text(json.dumps(results))
    figures = published_run_figures(folder)
    assert figures["whitespace BLEU"] == 40.1 and figures["steps"] == 120 and figures["epoch 5 eval_loss"] == 0.6
    for step in (24, 120):  # stopped after epoch 2
        for path in (folder / "checkpoints" / f"checkpoint-{step}").iterdir():
            path.unlink()
        (folder / "checkpoints" / f"checkpoint-{step}").rmdir()
    (folder / "results.json").unlink()
    figures = published_run_figures(folder)
    assert figures["validations"] == 2 and "epoch 1 eval_loss" in figures and "epoch 5 eval_loss" not in figures


def test_a_command_past_its_time_is_stopped_with_its_process_group(tmp_path, script) -> None:
    log = tmp_path / "log"
    started = time.monotonic()
    run_logged = script.multi30k_published.run_logged
    status = run_logged(["bash", "-c", "sleep 60 & echo started; wait"], log, 1.0, dict(os.environ))
    assert status is None
    assert time.monotonic() - started < 30  # the shell and its sleep stopped, not waited for
    assert log.read_text() == "started\n"
    assert run_logged(["bash", "-c", "exit 3"], log, 10.0, dict(os.environ)) == 3


def test_cublas12_comes_from_a_wheel_where_none_is_installed(tmp_path, script, monkeypatch) -> None:
    monkeypatch.setattr(script.ctranslate2, "cublas12_folders", lambda: [])
    cublas12_libraries = script.ctranslate2.cublas12_libraries
    cache = tmp_path / "cache"
    with pytest.raises(LookupError, match="none installed"):
        cublas12_libraries(None, cache, pip=False)
    wheel = tmp_path / "nvidia_cublas_cu12-12.9.1.4-py3-none-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("nvidia/cublas/lib/libcublas.so.12", b"cublas")
    with pytest.raises(LookupError, match="lacks nvidia/cublas/lib/libcublasLt.so.12"):
        cublas12_libraries(wheel, cache, pip=False)
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("nvidia/cublas/lib/libcublasLt.so.12", b"cublasLt")
    paths, source = cublas12_libraries(wheel, cache, pip=False)
    assert [Path(path).name for path in paths] == ["libcublasLt.so.12", "libcublas.so.12"]  # in load order
    assert Path(paths[1]).read_bytes() == b"cublas"
    assert source == f"extracted from {wheel}"
    assert cublas12_libraries(None, cache, pip=False) == (paths, f"found in {Path(paths[0]).parent}")


def test_two_processes_step_as_one_process_with_the_whole_batch(script) -> None:
    """FSDP2, sharded per layer; DDP differs by one line (the wrapper) and costs as much to start."""
    outcome = script.distributed.two_process_step("FSDP", "gloo", script.sizes.TINY)
    assert outcome["equal (1e-3 of the update)"], outcome
