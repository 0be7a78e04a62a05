"""Section ctranslate2: the generation section's model and sources decoded by CTranslate2 (float16 and int8_float16 on
CUDA, float32 and int8 on a CPU) in a child process: output tokens/s."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from speed_comparison import word_tokenizer

from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.files import write_text
from hf_vaswani.interop.export import write_ctranslate2

from .generation import decoding_shapes, decoding_sources
from .names import item, shape_name
from .run import Run, Section, Skipped, first_line

CT2_COMPUTE_TYPES = {"cuda": ("float16", "int8_float16"), "cpu": ("float32", "int8")}
CUBLAS12 = ("libcublasLt.so.12", "libcublas.so.12")  # in load order: libcublas needs libcublasLt


def body(section: Section, wheel: Path | None) -> None:
    """The generation section's model and sources decoded by CTranslate2 in a child process, which on CUDA first loads
    cuBLAS 12 (CTranslate2's wheel links libcublas.so.12; a CUDA 13 machine has libcublas.so.13)."""
    run = section.run
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise Skipped("ctranslate2 is not installed") from None
    except Exception as error:  # its libraries do not load in this process
        raise Skipped(f"ctranslate2 does not import: {type(error).__name__}: {first_line(error)}") from None
    compute_types = CT2_COMPUTE_TYPES[run.device.type]
    items = {
        (compute_type, batch, beams): item(shape_name(batch, beams), f"CTranslate2 {compute_type}")
        for compute_type in compute_types
        for batch, beams in decoding_shapes(run.sizes)
    }
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / "ct2"
        section.measure("export: write_ctranslate2, float16", 30, partial(ctranslate2_export, run, model_dir))
        libraries: list[str] = []
        why_not = "" if model_dir.is_dir() else "no exported model (see the export item)"
        if not why_not and run.device.type == "cuda":
            section.measure("cuBLAS 12", 60, partial(cublas12_measurement, wheel, libraries))
            why_not = "" if libraries else "no cuBLAS 12 to load (see the cuBLAS 12 item)"
        if not why_not:
            child = partial(ctranslate2_child_run, run, model_dir, compute_types, libraries, measured)
            section.measure("child process", 90, child)
            why_not = "not measured by the child process (see its item)"
    for (compute_type, batch, beams), name in items.items():
        section.record(name, measured.get(f"{compute_type} {batch} {beams}", {"skipped": why_not}))


def ctranslate2_export(run: Run, model_dir: Path) -> dict[str, Any]:
    """The generation section's model (same seed, fp32 on the CPU) by hf_vaswani's CTranslate2 export, in float16;
    CTranslate2 converts it to each compute type as it loads it."""
    config = run.model_config()
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).eval()
    write_ctranslate2(model, word_tokenizer(config.vocab_size), model_dir, "float16")
    return {"quantization": "float16", "vocabulary": config.vocab_size}


def cublas12_folders() -> list[Path]:
    """Folders that hold cuBLAS 12 already: the nvidia-cublas-cu12 wheel's in this Python's paths, a CUDA 12 toolkit's,
    or where the loader's cache has it."""
    candidates = [Path(entry) / "nvidia" / name / "lib" for entry in sys.path if entry for name in ("cublas", "cu12")]
    candidates += sorted(Path("/usr/local").glob("cuda-12*/lib64")) + sorted(
        Path("/usr/local").glob("cuda-12*/targets/*/lib")
    )
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        cache = ""
    candidates += [Path(line.split("=>")[-1].strip()).parent for line in cache.splitlines() if CUBLAS12[1] in line]
    return [folder for folder in dict.fromkeys(candidates) if all((folder / name).is_file() for name in CUBLAS12)]


def cublas12_libraries(wheel: Path | None, cache: Path, pip: bool = True) -> tuple[list[str], str]:
    """The paths of libcublasLt.so.12 and libcublas.so.12, in load order, and where they came from: found installed,
    else extracted from `wheel` (an nvidia-cublas-cu12 wheel file) into `cache`, else installed into `cache` by pip
    (where `pip`); LookupError with each way's failure otherwise."""
    failures = []
    earlier = [cache / way / "nvidia" / "cublas" / "lib" for way in ("wheel", "pip")]  # an earlier run's
    for folder in cublas12_folders() + earlier:
        if all((folder / name).is_file() for name in CUBLAS12):
            return [str(folder / name) for name in CUBLAS12], f"found in {folder}"
    if wheel is None:
        failures.append("none installed")
    elif not wheel.is_file():
        failures.append(f"--cublas12-wheel {wheel}: no such file")
    elif not zipfile.is_zipfile(wheel):
        failures.append(f"--cublas12-wheel {wheel} is not a wheel file")
    else:
        folder = cache / "wheel" / "nvidia" / "cublas" / "lib"
        with zipfile.ZipFile(wheel) as archive:
            members = [f"nvidia/cublas/lib/{name}" for name in CUBLAS12]
            absent = [member for member in members if member not in archive.namelist()]
            if absent:
                failures.append(f"--cublas12-wheel {wheel.name} lacks {', '.join(absent)}")
            else:
                for member in members:
                    archive.extract(member, cache / "wheel")
                return [str(folder / name) for name in CUBLAS12], f"extracted from {wheel}"
    if pip:
        target = cache / "pip"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check"]
        command += ["--retries", "0", "--timeout", "15", "--target", str(target), "nvidia-cublas-cu12"]
        try:
            installed = subprocess.run(command, capture_output=True, text=True, timeout=300)
            lines = installed.stderr.strip().splitlines()
            folder = target / "nvidia" / "cublas" / "lib"
            if installed.returncode == 0 and all((folder / name).is_file() for name in CUBLAS12):
                return [str(folder / name) for name in CUBLAS12], "installed by pip install nvidia-cublas-cu12"
            failures.append(f"pip install nvidia-cublas-cu12: {lines[-1] if lines else installed.returncode}")
        except subprocess.TimeoutExpired:
            failures.append("pip install nvidia-cublas-cu12: no answer in 300 s")
    raise LookupError("; ".join(failures))


def cublas12_measurement(wheel: Path | None, libraries: list[str]) -> dict[str, Any]:
    try:
        paths, source = cublas12_libraries(wheel, Path(tempfile.gettempdir()) / "gpu_figures_cublas12")
    except LookupError as failures:
        return {"skipped": f"no libcublas.so.12: {failures}"}
    libraries[:] = paths
    return {"source": source}


def ctranslate2_child(job_file: str) -> None:
    """CTranslate2's decoding speeds, in a process of its own (run from this function's source): the job's libraries
    loaded first, globally, so that CTranslate2's libcublas.so.12 resolves to them; the results written after each
    measurement, so that a crash keeps the ones before it."""
    import ctypes
    import json
    import os
    import time

    with open(job_file) as handle:
        job = json.load(handle)
    for library in job["libraries"]:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    import ctranslate2

    deadline = time.monotonic() + job["seconds"]
    results: dict = {"ctranslate2": ctranslate2.__version__, "loaded": {}, "items": {}}

    def save() -> None:
        with open(job["results"] + ".partial", "w") as handle:
            json.dump(results, handle)
        os.replace(job["results"] + ".partial", job["results"])

    save()
    for compute_type in job["compute_types"]:
        try:
            translator = ctranslate2.Translator(
                job["model"], device=job["device"], compute_type=compute_type, intra_threads=job["threads"]
            )
        except Exception as error:
            results["loaded"][compute_type] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
            save()
            continue
        results["loaded"][compute_type] = "yes"
        for batch, beams in job["shapes"]:
            key = f"{compute_type} {batch} {beams}"
            if time.monotonic() > deadline:
                results["items"][key] = {"skipped": "time limit"}
                continue
            sources = job["sources"][:batch]
            options = dict(
                beam_size=beams,
                min_decoding_length=job["new_tokens"],
                max_decoding_length=job["new_tokens"],
                max_batch_size=batch,
            )
            try:
                for _ in range(job["warmup"]):
                    translator.translate_batch(sources, **options)
                started = time.perf_counter()
                for _ in range(job["repeats"]):  # each call returns once decoded: the host waits for the device
                    output = translator.translate_batch(sources, **options)
                seconds = (time.perf_counter() - started) / job["repeats"]
            except Exception as error:
                results["items"][key] = {
                    "error": f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
                }
                save()
                continue
            produced = len(output[0].hypotheses[0])
            results["items"][key] = {
                "output tokens/s": round(batch * produced / seconds, 1),
                "seconds a batch": round(seconds, 4),
                "output length": produced,
            }
            save()
        del translator


def ctranslate2_child_run(
    run: Run,
    model_dir: Path,
    compute_types: tuple[str, ...],
    libraries: list[str],
    measured: dict[str, Any],
) -> dict[str, Any]:
    """Run ctranslate2_child on the generation section's sources (padding left out) and collect what it measured."""
    vocab_size = run.model_config().vocab_size
    ids, mask = decoding_sources(run, vocab_size)
    tokenizer = word_tokenizer(vocab_size)
    rows = zip(ids.tolist(), mask.sum(1).tolist(), strict=True)
    sources = [tokenizer.convert_ids_to_tokens(row[:length]) for row, length in rows]
    program = textwrap.dedent(inspect.getsource(ctranslate2_child)) + "\nimport sys\nctranslate2_child(sys.argv[1])\n"
    with tempfile.TemporaryDirectory() as folder:
        job = {
            "model": str(model_dir),
            "device": run.device.type,
            "compute_types": list(compute_types),
            "libraries": libraries,
            "shapes": decoding_shapes(run.sizes),
            "sources": sources,
            "new_tokens": run.sizes.new_tokens,
            "warmup": 1,
            "repeats": run.sizes.repeats,
            "threads": int(os.environ.get("OMP_NUM_THREADS") or 0),
            "seconds": max(1.0, run.seconds_left() - 10),
            "results": str(Path(folder) / "results.json"),
        }
        write_text(Path(folder) / "job.json", json.dumps(job))
        command = [sys.executable, "-c", program, str(Path(folder) / "job.json")]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=max(1.0, run.seconds_left()))
            status, lines = child.returncode, child.stderr.strip().splitlines()
        except subprocess.TimeoutExpired:
            status, lines = "stopped at the time limit", []
        results_file = Path(job["results"])
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
    measured.update(results.get("items", {}))
    outcome: dict[str, Any] = {"exit status": status, "ctranslate2": results.get("ctranslate2")}
    outcome.update({f"loaded {compute_type}": loaded for compute_type, loaded in results.get("loaded", {}).items()})
    if status != 0 and lines:
        outcome["last error line"] = lines[-1]
    return outcome
