"""The project's structural rules: dependency direction and the mirrored public API of reference/ and fused/."""

import ast
import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("cases", "reference", "fused", "parity", "reports")
# package -> packages it must never import
FORBIDDEN = {
    "cases": {"reference", "fused", "parity", "reports"},
    "reference": {"fused", "parity", "reports"},
    "fused": {"reference", "parity", "reports"},
    "parity": {"reports"},
}
MIRRORED = ("attention_layer", "core_attention", "compressor", "indexer")


def imported_packages(path: pathlib.Path) -> set[str]:
    """Top-level package names imported by one source file (absolute imports only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(package: str, root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        bad = imported_packages(path) & FORBIDDEN.get(package, set())
        found += [f"{path.relative_to(root)} imports {name}" for name in sorted(bad)]
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package):
    assert violations(package) == []


def adapter_violations(root: pathlib.Path = ROOT) -> list[str]:
    """adapters/ may import cases (and parity's hooks never); of fused only fused.kernels; never reference."""
    found = []
    for path in sorted((root / "adapters").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top in ("reference", "reports") or (top == "fused" and not name.startswith("fused.kernels")):
                    found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_adapters_import_only_cases_and_fused_kernels():
    assert adapter_violations() == []


def test_adapter_check_catches_a_composition_import(tmp_path):
    """Negative control: an adapter importing fused's composition is reported."""
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "bad.py").write_text("from fused.core_attention import run_core\nimport fused.kernels\n")
    assert adapter_violations(tmp_path) == ["adapters/bad.py imports fused.core_attention"]


def test_dependency_check_catches_a_forbidden_import(tmp_path):
    """Negative control: a reference module importing fused is reported."""
    pkg = tmp_path / "reference"
    pkg.mkdir()
    (pkg / "bad.py").write_text("from fused import core_attention\nimport torch\n")
    assert violations("reference", tmp_path) == ["reference/bad.py imports fused"]


def signatures(module) -> dict[str, str]:
    return {name: str(inspect.signature(getattr(module, name))) for name in MIRRORED}


def test_reference_and_fused_mirror_each_other():
    reference = pytest.importorskip("reference")
    fused = pytest.importorskip("fused")
    missing = [f"{m.__name__}.{n}" for m in (reference, fused) for n in MIRRORED if not hasattr(m, n)]
    assert not missing, f"public API incomplete: {missing}"
    assert signatures(reference) == signatures(fused)


def test_mirror_check_catches_a_signature_difference():
    """Negative control: two modules whose functions differ in one keyword are told apart."""
    import types

    def make(extra):
        mod = types.ModuleType("m")
        for name in MIRRORED:
            exec(f"def {name}(a, b, *, training=True{extra}): pass", mod.__dict__)
        return mod

    assert signatures(make("")) != signatures(make(", topk_indices=None"))
