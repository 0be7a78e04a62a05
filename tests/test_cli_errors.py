"""Every mistake in the inference commands is one line `vaswani <command>: error: ...`, exit code 2, no traceback;
no code from a model folder runs unless asked; no output is half-written or lost; a reader that closes the pipe ends a
command quietly."""

import contextlib
import errno
import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from helpers import refused
from tiny import SMALLEST_MODEL, save_random_checkpoints, save_untrained_folder

import hf_vaswani.cli
import hf_vaswani.decoding.loading
import hf_vaswani.files
from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.decoding.translation import translate
from hf_vaswani.text_io import print_lines


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_untrained_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def folder_copy(tiny_folder, tmp_path) -> Path:
    """A copy of the tiny folder that a test may damage."""
    return Path(shutil.copytree(tiny_folder, tmp_path / "model"))


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def marker_code(marker: Path) -> str:
    """Python that leaves `marker` behind when imported: proof that a folder's code ran."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"


def run_command(*argv: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_vaswani.cli", *argv], input=stdin, capture_output=True, text=True, timeout=300
    )


# 1. No code from a model folder runs unless asked


def test_a_folder_of_another_model_type_is_refused_and_its_code_never_runs(folder_copy, tmp_path) -> None:
    marker = tmp_path / "ran"
    edit_json(folder_copy / "config.json", model_type="evil")
    (folder_copy / "configuration_vaswani.py").write_text(marker_code(marker))
    result = run_command("translate", str(folder_copy), stdin="red cat\nblue dog\n")
    assert result.returncode == 2 and not marker.exists()
    assert result.stderr == (
        f"vaswani translate: error: {folder_copy} holds a model of type 'evil', not 'vaswani'; loading it would run "
        "code from the folder (allow that with trust_remote_code)\n"
    )
    assert result.stdout == ""  # no "run the custom code? [y/N]" prompt


def test_trust_remote_code_runs_the_code_of_another_model_type(folder_copy, tmp_path, capfd) -> None:
    marker = tmp_path / "ran"
    edit_json(folder_copy / "config.json", model_type="evil")
    (folder_copy / "configuration_vaswani.py").write_text(marker_code(marker))
    (tmp_path / "in.txt").write_text("red cat\n")
    with pytest.raises(
        (Exception, SystemExit)
    ):  # the planted module defines no config class: loading fails after it ran
        main(["translate", str(folder_copy), "--trust-remote-code", "--input", str(tmp_path / "in.txt")])
    assert marker.read_text() == "ran"


def test_a_vaswani_folder_loads_with_the_installed_classes_never_its_own_code(folder_copy, tmp_path) -> None:
    marker = tmp_path / "ran"
    for module in folder_copy.glob("*.py"):
        module.write_text(marker_code(marker))
    model, tokenizer = load_model_folder(folder_copy)
    assert type(model) is VaswaniForConditionalGeneration and not marker.exists()
    result = run_command("translate", str(folder_copy), "--num-beams", "1", stdin="red cat\n\nblue dog\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split("\n")) == 4 and result.stdout.split("\n")[1] == "" and not marker.exists()


def test_a_folder_with_a_custom_tokenizer_is_refused_without_a_prompt(folder_copy, tmp_path) -> None:
    marker = tmp_path / "ran"
    edit_json(
        folder_copy / "tokenizer_config.json",
        tokenizer_class="EvilTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]},
    )
    (folder_copy / "tokenization_evil.py").write_text(marker_code(marker))
    result = run_command("translate", str(folder_copy), stdin="y\ny\n")
    assert result.returncode == 2 and not marker.exists() and result.stdout == ""
    assert result.stderr.startswith(f"vaswani translate: error: cannot load the tokenizer of {folder_copy}: ")
    assert result.stderr.count("\n") == 1 and "custom code" in result.stderr


def test_pickled_weights_are_not_loaded(folder_copy, capfd) -> None:
    model = VaswaniForConditionalGeneration.from_pretrained(folder_copy)
    (folder_copy / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder_copy / "pytorch_model.bin")  # torch.load of a pickle can run code
    refused(capfd, ["translate", str(folder_copy)], str(folder_copy), "model.safetensors")


# 2. Weights that do not match their config


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"decoder_layers": 3}, "26 missing (first: model.decoder.layers.2."),
        ({"decoder_layers": 1}, "26 unexpected (first: model.decoder.layers.1."),
        ({"d_ff": 50}, "12 of another shape (first: model.decoder.layers.0.feed_forward.fc1.bias ([40] saved, [50]"),
        ({"positional_encoding": "learned"}, "2 missing (first: model.decoder.embeddings.positions.weight)"),
    ],
)
def test_a_config_that_does_not_match_the_weights_is_refused(folder_copy, capfd, changes, named) -> None:
    edit_json(folder_copy / "config.json", **changes)
    refused(capfd, ["translate", str(folder_copy)], f"the weights of {folder_copy} do not match its config.json", named)


def test_a_clean_folder_has_no_missing_weight(tiny_folder) -> None:
    # lm_head.weight is tied to the shared embedding: saved once, and not reported missing
    _, loading_info = VaswaniForConditionalGeneration.from_pretrained(tiny_folder, output_loading_info=True)
    assert not any(loading_info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated", "truncated header"])
def test_missing_or_damaged_weights_are_one_line_naming_the_file(folder_copy, capfd, damage) -> None:
    weights = folder_copy / "model.safetensors"
    content = weights.read_bytes()
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(
            {"empty": b"", "truncated": content[: len(content) // 2], "truncated header": content[:20]}[damage]
        )
    refused(capfd, ["translate", str(folder_copy)], str(folder_copy), "model.safetensors")


# 3. Inputs and outputs are checked before any work; outputs are written whole or not at all


def test_output_and_input_paths_are_checked_before_loading(tiny_folder, tmp_path, capfd, monkeypatch) -> None:
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr(hf_vaswani.decoding.loading, "load_model_folder", no_loading)
    (tmp_path / "in.txt").write_text("red cat\n")
    given_input = ["--input", str(tmp_path / "in.txt")]
    model = str(tiny_folder)
    refused(capfd, ["translate", model, *given_input, "--output", str(tmp_path / "no" / "out.txt")], "no directory")
    refused(capfd, ["translate", model, *given_input, "--output", str(tmp_path)], "is a directory, not a file")
    inside_a_file = str(tmp_path / "in.txt" / "out.txt")
    refused(capfd, ["translate", model, *given_input, "--output", inside_a_file], "in.txt is a file, not a directory")
    pair = ["--source", str(tmp_path / "in.txt"), "--target", str(tmp_path / "in.txt")]
    refused(capfd, ["score", model, *pair, "--output", str(tmp_path / "no" / "out.txt")], "--output", "no directory")
    refused(capfd, ["translate", model, "--input", str(tmp_path / "none.txt")], "--input", "no such file")
    refused(capfd, ["translate", model, "--input", str(tmp_path)], "--input", "a directory, not a file")
    reference = ["--reference", str(tmp_path / "in.txt")]
    refused(capfd, ["evaluate", model, "--source", str(tmp_path / "none.txt"), *reference], "--source", "no such file")
    refused(
        capfd,
        ["evaluate", model, "--reference", str(tmp_path / "none.txt"), "--source", str(tmp_path / "in.txt")],
        "--reference",
        "no such file",
    )


def test_an_output_that_is_an_input_file_is_refused_before_anything_is_read(
    tiny_folder, tmp_path, capfd, monkeypatch
) -> None:
    """The output replaces its file whole: the input's name typed twice, another spelling of it, or a link to it would
    lose the input."""

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr(hf_vaswani.decoding.loading, "load_model_folder", no_loading)
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "in.txt"
    source.write_text("red cat\n")
    (tmp_path / "symbolic.txt").symlink_to(source)
    os.link(source, tmp_path / "hard.txt")
    model = str(tiny_folder)
    for output in (str(source), "in.txt", "symbolic.txt", "hard.txt"):
        argv = ["translate", model, "--input", str(source), "--output", output]
        refused(capfd, argv, f"--output {output} is the --input file")
    (tmp_path / "target.txt").write_text("ROTE KATZE\n")
    for option, output in (("--source", "hard.txt"), ("--target", "target.txt")):
        argv = ["score", model, "--source", str(source), "--target", "target.txt", "--output", output]
        refused(capfd, argv, f"--output {output} is the {option} file")
    assert source.read_text() == "red cat\n" and (tmp_path / "target.txt").read_text() == "ROTE KATZE\n"


def test_a_failed_write_keeps_the_old_output_and_leaves_no_partial_file(tiny_folder, tmp_path, monkeypatch) -> None:
    (tmp_path / "in.txt").write_text("red cat\nblue dog\n")
    output = tmp_path / "out.txt"
    output.write_text("old translations\n")

    def write_half_then_fail(lines, target) -> None:
        target.write("half\n")
        raise OSError("No space left on device")

    monkeypatch.setattr(hf_vaswani.files, "print_lines", write_half_then_fail)
    with pytest.raises(SystemExit):
        main(["translate", str(tiny_folder), "--input", str(tmp_path / "in.txt"), "--output", str(output)])
    assert output.read_text() == "old translations\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def test_translations_replace_the_output_file_whole(tiny_folder, tmp_path) -> None:
    (tmp_path / "in.txt").write_text("red cat\nblue dog\n")
    output = tmp_path / "out.txt"
    output.write_text("old\n")
    main(["translate", str(tiny_folder), "--input", str(tmp_path / "in.txt"), "--output", str(output)])
    assert len(output.read_text().split("\n")) == 3 and output.stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def _umask() -> int:
    umask = os.umask(0)  # reading the mask means setting it
    os.umask(umask)
    return umask


def test_average_refuses_an_existing_output_and_missing_or_damaged_checkpoints(tmp_path, capfd) -> None:
    first, second = save_random_checkpoints(tmp_path / "run", (1, 2))
    existing = tmp_path / "averaged"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    refused(
        capfd, ["average", str(first), str(second), "--output", str(existing)], f"--output {existing} already exists"
    )
    assert [path.name for path in existing.iterdir()] == ["keep.txt"]
    output = str(tmp_path / "new")
    refused(capfd, ["average", "--checkpoint-dir", str(tmp_path / "none"), "--output", output], "none")
    refused(capfd, ["average", "--output", output], "give checkpoint folders or --checkpoint-dir")
    weights = second / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    refused(capfd, ["average", str(first), str(second), "--output", output], str(weights))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["averaged", "run"]  # no partial folder left


def test_average_writes_a_complete_folder(tmp_path, capfd) -> None:
    first, second = save_random_checkpoints(tmp_path / "run", (1, 2))
    main(["average", str(first), str(second), "--output", str(tmp_path / "averaged")])
    averaged = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "averaged")
    assert averaged.config.d_model == SMALLEST_MODEL["d_model"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["averaged", "run"]


# 4. One input line, one output line


def test_only_newline_ends_a_line(tiny_folder, tmp_path) -> None:
    text = "red\rcat\nblue\x0cdog\u2028moon\nsun\x85tree\r\n\nlast"
    (tmp_path / "in.txt").write_bytes(text.encode())
    main(["translate", str(tiny_folder), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt")])
    lines = (tmp_path / "out.txt").read_bytes().decode().split("\n")
    assert len(lines) == 6 and lines[-1] == "" and lines[3] == ""  # 5 input lines, the 4th empty
    result = run_command("translate", str(tiny_folder), stdin=text)
    assert result.returncode == 0 and result.stdout.count("\n") == 5 and result.stdout.split("\n")[3] == ""


def test_line_separators_inside_a_translation_become_spaces(tmp_path) -> None:
    path = tmp_path / "out.txt"
    with open(path, "w", encoding="utf-8", newline="\n") as target:
        print_lines(["a\rb", "c\u2028d\x0be", "f\ng"], target)
    assert path.read_bytes().decode().split("\n") == ["a b", "c d e", "f g", ""]


def test_empty_lines_and_files_translate_to_empty_output(tiny_folder, tmp_path) -> None:
    model, tokenizer = load_model_folder(tiny_folder)
    translations = translate(model, tokenizer, ["", "red cat", "  "], progress=False)
    assert translations[0] == "" and translations[2] == "" and translate(model, tokenizer, [], progress=False) == []
    (tmp_path / "empty.txt").write_text("")
    main(["translate", str(tiny_folder), "--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "out.txt")])
    assert (tmp_path / "out.txt").read_text() == ""


def test_a_string_instead_of_a_list_is_refused(tiny_folder) -> None:
    model, tokenizer = load_model_folder(tiny_folder)
    with pytest.raises(ValueError, match="not one string"):
        translate(model, tokenizer, "Hello")


# 5. Bad values and unreachable places: one line each


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--num-beams", "0"], "--num-beams must be an integer of at least 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer of at least 1, got 0"),
        (["--length-penalty", "nan"], "--length-penalty must be a finite number, got nan"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    ],
)
def test_bad_generation_values_are_refused_up_front(tiny_folder, capfd, monkeypatch, options, named) -> None:
    # loading would be a TypeError: a traceback
    monkeypatch.setattr(hf_vaswani.decoding.loading, "load_model_folder", None)
    refused(capfd, ["translate", str(tiny_folder), *options], named)


def test_an_option_that_would_be_ignored_is_refused(tiny_folder, tmp_path, capfd) -> None:
    refused(capfd, ["translate", str(tiny_folder), "--alignment-layer", "0"], "--alignment-layer", "--alignments")
    greedy = ["translate", str(tiny_folder), "--num-beams", "1", "--length-penalty", "0.6"]
    refused(capfd, greedy, "--length-penalty has no effect with --num-beams 1 (greedy decoding)")
    corpus = ["--train", "a.en", "a.de", "--test", "b.en", "b.de"]
    train = ["train", "--output-dir", str(tmp_path / "run")]
    refused(capfd, [*train, *corpus], "--train, --test: --data synthetic reads no such option (--data files does)")
    refused(capfd, [*train, "--data", "files", *corpus, "--hub-name", "wmt14"], "--hub-name", "--data hub does")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command", [["translate", "MODEL"], ["train", "--output-dir", "run"], ["average", "--output", "averaged"]]
)
def test_an_unknown_option_is_one_line_naming_its_command(tiny_folder, tmp_path, capfd, monkeypatch, command) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [str(tiny_folder) if word == "MODEL" else word for word in command]
    refused(capfd, [*argv, "--no-such-option"], "unrecognized arguments: --no-such-option")
    assert list(tmp_path.iterdir()) == []


def test_int8_with_a_half_precision_is_refused(tiny_folder, capfd) -> None:
    refused(capfd, ["translate", str(tiny_folder), "--int8", "--dtype", "bf16"], "int8", "fp32", "bf16")


def test_a_float_type_this_cpu_has_no_instructions_for_is_one_line(tiny_folder, tmp_path, capfd, monkeypatch) -> None:
    from hf_vaswani.kernels import cpu_features

    monkeypatch.setattr(cpu_features, "has_native_instructions", lambda dtype: dtype == torch.float32)
    text = tmp_path / "text.txt"
    text.write_text("red cat\n")
    files = ["--source", str(text)]
    for dtype, instructions in [("bf16", "AVX512-BF16 or AMX-BF16"), ("fp16", "AVX512-FP16 or AMX-FP16")]:
        for command in (
            ["translate"],
            ["score", *files, "--target", str(text)],
            ["evaluate", *files, "--reference", str(text)],
        ):
            argv = [command[0], str(tiny_folder), *command[1:], "--dtype", dtype]
            refused(capfd, argv, f"dtype {dtype} on the CPU", instructions, "use fp32")


def test_a_bad_device_is_one_line(tiny_folder, capfd) -> None:
    refused(capfd, ["translate", str(tiny_folder), "--device", "gpu7"], "device 'gpu7' is not a torch device")
    refused(capfd, ["translate", str(tiny_folder), "--device", "meta", "--int8"], "int8 inference runs on CPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(tiny_folder, capfd) -> None:
    refused(capfd, ["translate", str(tiny_folder), "--device", "cuda"], "device 'cuda': CUDA is not available")


@pytest.mark.parametrize("missing", ["/no/such/model", "no/such/model/at/all", "runs/model"])
def test_a_missing_model_folder_is_one_line(tmp_path, capfd, monkeypatch, missing) -> None:
    monkeypatch.chdir(tmp_path)
    refused(capfd, ["translate", missing], f"no model folder at {missing}")


def test_a_folder_without_config_is_one_line(tmp_path, capfd) -> None:
    (tmp_path / "test.txt").write_text("red cat\n")
    test_set = ["--source", str(tmp_path / "test.txt"), "--reference", str(tmp_path / "test.txt")]
    refused(capfd, ["evaluate", str(tmp_path), *test_set], f"{tmp_path} is not a model folder: it holds no config.json")
    (tmp_path / "config.json").write_text("{")
    refused(capfd, ["evaluate", str(tmp_path), *test_set], "config.json is not valid JSON")


def test_plot_attention_names_the_valid_layers(tiny_folder, tmp_path, capfd) -> None:
    output = ["--output-dir", str(tmp_path / "plots")]
    refused(
        capfd,
        ["plot-attention", str(tiny_folder), "--sentence", "red cat", "--layer", "99", *output],
        "layer 99 does not exist: the model has layers 0 to 1 (or -1 to -2)",
    )
    refused(capfd, ["plot-attention", str(tiny_folder), "--sentence", "red cat", "--layer", "-3", *output], "layer -3")
    (tmp_path / "file").write_text("")
    refused(
        capfd,
        ["plot-attention", str(tiny_folder), "--sentence", "red cat", "--output-dir", str(tmp_path / "file")],
        str(tmp_path / "file"),
    )


def test_a_failed_plot_keeps_the_old_one_and_leaves_no_partial_file(tiny_folder, tmp_path, capfd, monkeypatch) -> None:
    from matplotlib.figure import Figure

    plots = tmp_path / "plots"
    plots.mkdir()
    old = plots / "encoder_attention.png"
    old.write_bytes(b"an earlier plot")

    def disk_full(figure, path, **options) -> None:
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(Figure, "savefig", disk_full)
    arguments = ["plot-attention", str(tiny_folder), "--sentence", "red cat", "--output-dir", str(plots)]
    refused(capfd, arguments, "No space left on device", "encoder_attention.png")
    assert old.read_bytes() == b"an earlier plot" and [path.name for path in plots.iterdir()] == [old.name]


def test_push_with_the_hub_unreachable_is_one_line(folder_copy, capfd, monkeypatch) -> None:
    import httpx2
    from huggingface_hub import HfApi

    (folder_copy / "README.md").write_text("# card\n")
    # conftest sets HF_HUB_OFFLINE: huggingface_hub's OfflineModeIsEnabled
    refused(capfd, ["push", str(folder_copy), "someone/model"], "someone/model", "offline mode is enabled")

    def unreachable(*args, **kwargs):
        raise httpx2.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    refused(
        capfd,
        ["push", str(folder_copy), "someone/model"],
        f"could not push {folder_copy} to the Hub repo someone/model: [Errno -2] Name or service not known",
    )


def test_convert_refuses_a_missing_source_and_an_existing_output(tiny_folder, tmp_path, capfd) -> None:
    refused(capfd, ["convert", "--from", "marian", str(tmp_path / "none"), str(tmp_path / "out")], "no model folder at")
    refused(capfd, ["convert", "--from", "marian", str(tiny_folder), str(tiny_folder)], "already exists")


def test_a_bug_still_shows_its_traceback(tiny_folder, monkeypatch) -> None:
    def buggy(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(hf_vaswani.cli, "generation_options", buggy)
    with pytest.raises(KeyError):
        main(["translate", str(tiny_folder)])


UNEXPECTED = """
import sys

import hf_vaswani.training.averaging
from hf_vaswani.cli import main


def broken(*args, **kwargs):
    raise KeyError("a bug inside the package")


hf_vaswani.training.averaging.average_checkpoints = broken
main(sys.argv[1:])
"""


def test_a_mistake_is_one_line_and_an_unexpected_error_keeps_its_traceback(tmp_path, tiny_folder) -> None:
    """As a user runs the command, in a process of its own: the user's mistake gives one line and exit code 2; an
    error the package did not expect (here a bug planted in averaging) its whole traceback, saying it is a bug."""
    command = [sys.executable, "-c", UNEXPECTED, "average", str(tiny_folder)]
    mistake = subprocess.run([*command, "--output", str(tiny_folder)], capture_output=True, text=True, timeout=300)
    assert mistake.returncode == 2
    assert mistake.stderr.startswith("vaswani average: error: ") and mistake.stderr.count("\n") == 1, mistake.stderr
    assert "Traceback" not in mistake.stderr
    bug = subprocess.run(
        [*command, "--output", str(tmp_path / "averaged")], capture_output=True, text=True, timeout=300
    )
    assert bug.returncode == 1
    assert bug.stderr.startswith("Traceback (most recent call last):"), bug.stderr
    assert "KeyError: 'a bug inside the package'" in bug.stderr
    assert bug.stderr.rstrip().endswith(
        "vaswani average: this is a bug in hf_vaswani, not a mistake in the command: please report it with the "
        "command line and this traceback"
    ), bug.stderr
    assert not (tmp_path / "averaged").exists()


# 6. A reader that closes the pipe


def smallest_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) holding one page, the least the kernel gives: a command writing into it is still
    writing when its output is a few pages long."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1)  # rounded up to one page
    return read_end, write_end


def pipe_size() -> int:
    read_end, write_end = smallest_pipe()
    size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    os.close(read_end)
    os.close(write_end)
    return size


def run_into_closing_reader(argv: list[str], lines_read: int, environment: dict[str, str]) -> tuple[int, str, bytes]:
    """Run `vaswani ARGV` with its stdout the smallest pipe, read by this process: `lines_read` lines, then the pipe
    is closed, as `head -1` closes it. Returns the exit status, stderr and what was read."""
    read_end, write_end = smallest_pipe()
    command = [sys.executable, "-m", "hf_vaswani.cli", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment}
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.PIPE, env=env) as run:
        os.close(write_end)
        with os.fdopen(read_end, "rb", buffering=0) as reader:  # unbuffered: no more than those lines is read
            read = b"".join(reader.readline() for _ in range(lines_read))
        stderr = run.stderr.read().decode()
        status = run.wait(timeout=300)
    return status, stderr, read


@pytest.mark.parametrize("buffering", [{}, {"PYTHONUNBUFFERED": "1"}], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("command", ["translate", "score"])
def test_a_reader_that_closes_the_pipe_after_one_line_ends_the_command_quietly(
    tiny_folder, tmp_path, command, buffering
) -> None:
    """`vaswani translate ... | head -1`: no message, and exit status 0, so that a pipeline under `set -o pipefail`
    succeeds. Every output line is at least its "\\n" and there are 4 pipes' worth of lines: more than the pipe and
    the command's own 8 KiB buffer hold, so the command is still writing when its reader goes."""
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("red cat sun\nblue dog\n" * 2 * pipe_size())
    arguments = {
        "translate": ["--input", str(sentences), "--num-beams", "1"],
        "score": ["--source", str(sentences), "--target", str(sentences)],
    }[command]
    status, stderr, read = run_into_closing_reader(
        [command, str(tiny_folder), *arguments, "--batch-size", "1024"], 1, buffering
    )
    assert read.endswith(b"\n")
    assert stderr == ""
    assert status == 0


def test_a_reader_that_closes_the_pipe_before_evaluate_prints_ends_it_quietly(tiny_folder, tmp_path) -> None:
    """evaluate prints a few hundred bytes at its end, which a pipe takes whole: its reader closes before it writes."""
    (tmp_path / "test.src").write_text("red cat sun\nblue dog\n")
    (tmp_path / "test.ref").write_text("RED CAT SUN\nBLUE DOG\n")
    argv = ["evaluate", str(tiny_folder), "--source", str(tmp_path / "test.src")]
    status, stderr, _ = run_into_closing_reader([*argv, "--reference", str(tmp_path / "test.ref")], 0, {})
    assert stderr == ""
    assert status == 0


def test_the_progress_bar_shows_on_a_terminal_only(tiny_folder, tmp_path) -> None:
    """stderr a terminal: translate shows its progress; the pipe tests above show that elsewhere it prints nothing."""
    (tmp_path / "in.txt").write_text("red cat sun\nblue dog\n")
    terminal, terminal_of_the_command = pty.openpty()
    # 24 rows of 80 columns: a new terminal has none, and a progress bar would fit nothing into it
    fcntl.ioctl(terminal_of_the_command, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    command = [sys.executable, "-m", "hf_vaswani.cli", "translate", str(tiny_folder), "--input"]
    result = subprocess.run(
        [*command, str(tmp_path / "in.txt")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=terminal_of_the_command,
        timeout=300,
    )
    os.close(terminal_of_the_command)
    shown = b""
    with contextlib.suppress(OSError):  # EIO: Linux's end of a terminal whose other end is closed, all read
        while chunk := os.read(terminal, 4096):
            shown += chunk
    os.close(terminal)
    assert result.returncode == 0 and result.stdout.count(b"\n") == 2
    assert b"Translating" in shown
