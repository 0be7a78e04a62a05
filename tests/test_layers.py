"""The package's layers: decoding, interop and serving sit below training, so that using, converting or serving a model
never loads the training recipe. Checked over every import of their modules, those inside functions included."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_vaswani"
BELOW_TRAINING = ("decoding", "interop", "serving")


def imported_modules(source: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of each import in `source`, relative ones resolved against its package."""
    package = source.parent.relative_to(PACKAGE.parent).parts
    imports = []
    for node in ast.walk(ast.parse(source.read_text(), filename=str(source))):
        if isinstance(node, ast.Import):
            imports += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from .. import training` names the module in its alias
            imports += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return imports


@pytest.mark.parametrize("layer", BELOW_TRAINING)
def test_no_module_below_training_imports_from_it(layer: str) -> None:
    upward = [
        f"{source.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for source in sorted((PACKAGE / layer).rglob("*.py"))
        for line, module in imported_modules(source)
        if module == "hf_vaswani.training" or module.startswith("hf_vaswani.training.")
    ]
    assert not upward, "\n".join(upward)
