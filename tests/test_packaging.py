"""A normal (non-editable) install carries every file the package reads at run time, not only its Python modules."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_vaswani"
# Resources named in the code: `resources.files("hf_vaswani").joinpath("a/b")` and `Path(__file__)... / "a" / "b"`.
JOINPATH = re.compile(r"""\.joinpath\(\s*["']([^"']+)["']""")
FILE_RELATIVE = re.compile(r"Path\(__file__\)[^\n]*")
PATH_PART = re.compile(r"""/\s*["']([^"']+)["']""")


def checkout_files() -> list[str]:
    """The project's files as a checkout holds them: tracked ones and new ones git does not ignore."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the project's git checkout")
    return sorted(name for name in set(listed.split("\0")) if name and (ROOT / name).exists())


def named_resources(sources: list[Path]) -> set[str]:
    """Package-relative paths that the code opens through importlib.resources or next to its own file."""
    named = set()
    for source in sources:
        text = source.read_text()
        named.update(JOINPATH.findall(text))
        for expression in FILE_RELATIVE.findall(text):
            parts = PATH_PART.findall(expression)
            if parts:
                package_dir = source.parent.relative_to(ROOT / PACKAGE)
                named.add((package_dir / Path(*parts)).as_posix())
    return named


def test_the_wheel_holds_every_file_the_package_reads(tmp_path) -> None:
    files = checkout_files()
    # Build from a copy: an in-tree build would write build/ and egg-info into the working tree.
    tree = tmp_path / "tree"
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name, follow_symlinks=False)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())

    package_files = {name for name in files if name.startswith(f"{PACKAGE}/")}
    assert f"{PACKAGE}/interop/model_card.md" in package_files  # the card template is a real file inside the package
    assert package_files - in_wheel == set()
    resources = named_resources([ROOT / name for name in package_files if name.endswith(".py")])
    assert "interop/model_card.md" in resources and "decoding/evaluate_metrics/sacrebleu_local" in resources
    for resource in resources:
        path = f"{PACKAGE}/{resource}"
        assert path in in_wheel or any(name.startswith(path + "/") for name in in_wheel), resource
