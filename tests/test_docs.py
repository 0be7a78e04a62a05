"""The docs cannot drift from the code: the README's Python runs, every `vaswani` command line of README.md and
docs/*.md parses with the current command-line parser, as every command line of transformers' example script does with
the script's, and every link, file and `hf_vaswani.` name they mention exists."""

import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import run_translation_options
from tiny import save_untrained_folder

from hf_vaswani.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PACKAGE_NAME = re.compile(r"\bhf_vaswani(?:\.[A-Za-z_]\w*)+")
FILE_NAME = re.compile(r"(?<![\w./-])[\w./-]+\.(?:py|sh)\b")
SHELL_OPERATORS = set("();<>|&")
# A command's own message ("vaswani train: error: ..."), quoted in the prose: not a command line.
COMMAND_MESSAGE = re.compile(r"vaswani [\w-]+: ")
EXAMPLE_SCRIPT = "run_translation.py"
# Files the docs name that are not this repository's: transformers' example script, and the metric script that the
# commands beside it write.
FILES_ELSEWHERE = {f"examples/pytorch/translation/{EXAMPLE_SCRIPT}", EXAMPLE_SCRIPT, "sacrebleu/sacrebleu.py"}
# The README's Python opens the main job's model folder by this path, relative to the working directory.
DEMO_MODEL = Path("demo_output") / "model"


@dataclass(frozen=True)
class Snippet:
    """A piece of a Markdown file: its text and the line it starts on."""

    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[tuple[str, Snippet]]:
    """Each fenced code block of `path` with its language (empty when none is given), in order."""
    blocks = []
    language, start, lines = None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and language is None:
            language, start, lines = fence.group(1), number + 1, []
        elif fence and not fence.group(1):
            blocks.append((language, Snippet(path, start, "\n".join(lines) + "\n")))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def prose(path: Path) -> str:
    """`path` with its fenced blocks blanked out, line numbers kept."""
    lines = path.read_text().splitlines()
    inside = False
    for number, line in enumerate(lines):
        fence = FENCE.match(line)
        if fence and (not inside or not fence.group(1)):  # a fence opens with or without a language, closes without
            inside = not inside
        if fence or inside:
            lines[number] = ""
    return "\n".join(lines)


def code_spans(path: Path) -> list[Snippet]:
    """The inline code of `path`'s prose, whitespace (line breaks included) collapsed."""
    text = prose(path)
    return [
        Snippet(path, text.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split()))
        for match in CODE_SPAN.finditer(text)
    ]


def shell_lines(block: Snippet) -> list[Snippet]:
    """The logical lines of a shell block: continuation lines joined, blank lines dropped."""
    logical, start, pending = [], block.line, ""
    for offset, line in enumerate(block.text.splitlines()):
        if not pending:
            start = block.line + offset
        pending += line.strip() if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        if pending.strip():
            logical.append(Snippet(block.path, start, pending.strip()))
        pending = ""
    return logical


def words(text: str) -> list[str]:
    """The shell's words of one command line, comments dropped, operators (`>`, `|`, `&&`, ...) as words of their own;
    nothing expanded."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def vaswani_arguments(text: str) -> list[str] | None:
    """The arguments a command line gives the `vaswani` command (run as `vaswani` or `-m hf_vaswani.cli`, under any
    launcher), up to the first shell operator; None when the line does not run it."""
    tokens = words(text)
    for index, token in enumerate(tokens):
        if token == "vaswani" or (token == "hf_vaswani.cli" and index > 0 and tokens[index - 1] == "-m"):
            arguments = []
            for argument in tokens[index + 1 :]:
                if set(argument) <= SHELL_OPERATORS:
                    break
                arguments.append(argument)
            return arguments
    return None


def command_lines() -> list[Snippet]:
    """Every `vaswani` command line of the docs: shell blocks' lines running it, and inline code starting with it."""
    found = []
    for path in DOCS:
        for language, block in fenced_blocks(path):
            if language in ("bash", "sh", "shell", "console"):
                found += [line for line in shell_lines(block) if vaswani_arguments(line.text) is not None]
        found += [
            span
            for span in code_spans(path)
            if span.text.startswith("vaswani ") and not COMMAND_MESSAGE.match(span.text)
        ]
    return found


def example_script_arguments(text: str) -> list[str] | None:
    """The arguments a command line gives transformers' example script (run by `python` or `torchrun`); None when the
    line does not run it."""
    tokens = words(text)
    for index, token in enumerate(tokens):
        if token.endswith(EXAMPLE_SCRIPT):
            return tokens[index + 1 :]
    return None


def example_script_lines() -> list[Snippet]:
    """Every shell line of the docs that runs transformers' example script."""
    return [
        line
        for path in DOCS
        for language, block in fenced_blocks(path)
        if language in ("bash", "sh", "shell", "console")
        for line in shell_lines(block)
        if example_script_arguments(line.text) is not None
    ]


def parse(arguments: list[str]) -> str | None:
    """None when the `vaswani` parser accepts `arguments` (`--help` included), else its error message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            build_parser().parse_args(arguments)
    except SystemExit as exit:
        if exit.code not in (0, None):
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def test_the_docs_have_what_this_file_checks() -> None:
    """Guards the extraction: with the README's blocks or commands missed, the tests below would check nothing."""
    assert any(language == "python" for language, _ in fenced_blocks(README))
    assert {line.path for line in command_lines()} >= {README, ROOT / "docs" / "training.md"}
    assert {line.path for line in example_script_lines()} == {ROOT / "docs" / "training.md"}


def test_the_readme_python_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python blocks, in order and in one namespace, in a folder holding a model at `demo_output/model`
    (a tiny untrained one: the blocks must run, not translate well)."""
    save_untrained_folder(tmp_path / DEMO_MODEL)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    for language, block in fenced_blocks(README):
        if language != "python":
            continue
        code = compile(block.text, block.where(), "exec")  # a traceback then names the README's line
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(f"the Python block at {block.where()} fails: {error!r}") from error


@pytest.mark.parametrize("line", command_lines(), ids=Snippet.where)
def test_a_command_line_of_the_docs_parses(line: Snippet) -> None:
    arguments = vaswani_arguments(line.text)
    if len(arguments) == 1:  # a command named in prose ("`vaswani score` gives ...") must exist
        arguments = [arguments[0], "--help"]
    error = parse(arguments)
    assert error is None, f"{line.where()}: `{line.text}` does not parse with the current `vaswani` parser: {error}"


@pytest.mark.parametrize("line", example_script_lines(), ids=Snippet.where)
def test_a_command_line_of_the_example_script_parses(line: Snippet) -> None:
    """Its training arguments parse with transformers' parser, and its own options are among those that
    tests/interop/test_example_scripts.py runs the script's flow with."""
    run_translation_options(example_script_arguments(line.text))


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives `path`'s headings: lowercased, punctuation dropped, spaces as hyphens."""
    headings = [line.lstrip("#").strip() for line in prose(path).splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_links_and_files_the_docs_name_exist(path: Path) -> None:
    text = prose(path)
    missing = []
    for match in LINK.finditer(text):
        target, _, anchor = match.group(1).partition("#")
        if target.startswith(("http://", "https://")):
            continue
        linked = (path.parent / target).resolve() if target else path
        if not linked.exists() or (anchor and anchor not in heading_anchors(linked)):
            missing.append(f"line {text.count(chr(10), 0, match.start()) + 1}: link {match.group(1)}")
    code = [span.text for span in code_spans(path)] + [block.text for _, block in fenced_blocks(path)]
    for name in sorted({name for piece in code for name in FILE_NAME.findall(piece)}):
        if name not in FILES_ELSEWHERE and not ((ROOT / name).exists() or (ROOT / "hf_vaswani" / name).exists()):
            missing.append(f"file {name}")
    assert not missing, f"{path.relative_to(ROOT)} names what does not exist: {'; '.join(missing)}"


def test_every_module_of_the_package_is_in_the_code_layout() -> None:
    """docs/development.md's code layout names each file of the package by its path inside it (a subpackage's
    `__init__.py` aside), or a folder below a subpackage that holds it, and each subpackage (the other direction: the
    test above)."""
    named = {span.text for span in code_spans(ROOT / "docs" / "development.md")}
    package = ROOT / "hf_vaswani"
    files = [
        path.relative_to(package).as_posix()
        for path in package.rglob("*")
        if path.suffix in (".py", ".md") and "__pycache__" not in path.parts
        if not (path.name == "__init__.py" and path.parent != package)
    ]
    folders = [f"{path.name}/" for path in package.iterdir() if path.is_dir() and path.name != "__pycache__"]
    inner_folders = [name for name in named if name.endswith("/") and name.count("/") > 1]
    missing = sorted(
        name
        for name in files + folders
        if name not in named and not any(name.startswith(folder) for folder in inner_folders)
    )
    assert not missing, f"docs/development.md's code layout lacks {', '.join(missing)}"


def resolve(name: str) -> object:
    """The object a dotted `hf_vaswani.` name means: the longest importable module, then its attributes."""
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        module_name = ".".join(parts[:length])
        try:
            found: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        for attribute in parts[length:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_python_names_the_docs_give_exist(path: Path) -> None:
    missing = []
    for name in sorted(set(PACKAGE_NAME.findall(path.read_text()))):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name} ({error})")
    assert not missing, f"{path.relative_to(ROOT)} names Python that does not exist: {'; '.join(missing)}"
