"""A synthetic Megatron-LM tree for the API-generation tests: importable modules holding exactly the symbols a chosen
set of :class:`adapters.megatron.generations.Need` s asks for (no production code; nothing runs)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from adapters.megatron.generations import Need


def _module_text(needs: list[Need]) -> str:
    classes: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))  # class -> method -> kwargs
    plain, fields = set(), []
    for need in needs:
        if need.kind == "field":
            fields.append(need.name)
        elif need.kind == "module":
            continue
        elif "." in need.name:
            cls, method = need.name.split(".", 1)
            classes[cls][method] |= {need.detail} if need.kind == "kwarg" else set()
        else:
            plain.add(need.name)
    lines = ["import dataclasses", ""]
    if fields:
        plain.discard("MLATransformerConfig")
        lines += ["@dataclasses.dataclass", "class MLATransformerConfig:"]
        lines += [f"    {name}: object = None" for name in fields] + [""]
    for name in sorted(plain - set(classes)):
        lines += [f"def {name}(*args, **kwargs):", "    return None", ""]
    for cls, methods in classes.items():
        lines += [f"class {cls}:"]
        for method, kwargs in methods.items():
            params = "".join(f", {k}=None" for k in sorted(kwargs))
            lines += [f"    def {method}(self{params}):", "        return None"]
        lines += [""]
    return "\n".join(lines) + "\n"


def write_tree(root: Path, needs: list[Need]) -> Path:
    """``root`` holding ``megatron/...`` with one module per need's module (packages get ``__init__.py``)."""
    by_module: dict[str, list[Need]] = defaultdict(list)
    for need in needs:
        by_module[need.full_module].append(need)
    for module, found in by_module.items():
        parts = module.split(".")
        for depth in range(1, len(parts)):
            init = root.joinpath(*parts[:depth], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            init.touch()
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text(_module_text(found))
    (root / "megatron" / "core" / "utils.py").write_text("")
    return root
