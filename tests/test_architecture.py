"""The project's structural rules: dependency direction and the mirrored public API of reference/ and fused/."""

import ast
import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("cases", "reference", "fused", "adapters", "parity", "reports", "bench", "cli")
# package -> packages it must never import (ARCHITECTURE.md draws the same arrows). Every first-party package has a
# row, so a new package cannot slip in unchecked (test_every_package_has_a_row).
FORBIDDEN = {
    "cases": set(PACKAGES) - {"cases"},
    "reference": set(PACKAGES) - {"cases", "reference"},
    "fused": set(PACKAGES) - {"cases", "fused"},
    # the production code under test: the data model, and fused's kernel providers for the emulated provider only
    "adapters": {"reference", "fused", "parity", "reports", "bench", "cli"},
    "parity": {"reports", "bench", "cli"},  # implementations by name, like reference / fused (the mutation suites)
    "reports": {"reference", "fused", "adapters", "parity", "bench", "cli"},
    "bench": {"adapters", "cli"},
    "cli": set(),
}
#: (package, module prefix) pairs allowed although the package is not: adapters may use fused's kernel providers.
ALLOWED_SUBMODULES = {("adapters", "fused.kernels")}
MIRRORED = ("attention_layer", "core_attention", "compressor", "indexer", "query_latent")


def _dynamic_target(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("x.y")`` / ``import_module(f"x.{m}")`` / ``__import__("x")``:
    the literal (or an f-string's literal head), else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    return None


def imported_modules(path: pathlib.Path) -> set[str]:
    """Module paths imported by one source file: absolute ``import`` / ``from`` statements (any depth: function-local
    ones too) and ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node)):
            names.add(target)
    return names


def violations(package: str, root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for module in sorted(imported_modules(path)):
            top = module.split(".")[0]
            allowed = any(package == p and (module + ".").startswith(prefix + ".") for p, prefix in ALLOWED_SUBMODULES)
            if top in FORBIDDEN.get(package, set()) and not allowed:
                found.append(f"{path.relative_to(root)} imports {top}")
    return sorted(set(found))


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


@pytest.mark.parametrize("source", [
    "import importlib\n\ndef f():\n    return importlib.import_module('reports.render')\n",
    "from importlib import import_module\nmod = import_module('reports')\n",
    "import importlib\nm = 'x'\nmod = importlib.import_module(f'reports.{m}')\n",
    "def f():\n    from reports import render\n",
])
def test_dependency_check_sees_importlib_and_local_back_arrows(tmp_path, source):
    """Negative control: parity reaching reports through importlib (or a function-local import) is reported."""
    pkg = tmp_path / "parity"
    pkg.mkdir()
    (pkg / "bad.py").write_text(source)
    assert violations("parity", tmp_path) == ["parity/bad.py imports reports"]


def test_adapters_may_use_fused_kernels_only(tmp_path):
    pkg = tmp_path / "adapters"
    pkg.mkdir()
    (pkg / "ok.py").write_text("from fused.kernels.torch_provider import TorchKernels\n")
    assert violations("adapters", tmp_path) == []
    (pkg / "bad.py").write_text("from fused.core_attention import core_attention\nimport reference\n")
    assert violations("adapters", tmp_path) == ["adapters/bad.py imports fused", "adapters/bad.py imports reference"]


def test_every_package_has_a_row():
    """Every first-party package on disk is in the table (a new one must declare its arrows)."""
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert on_disk <= set(FORBIDDEN), sorted(on_disk - set(FORBIDDEN))


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
