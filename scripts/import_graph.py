"""Measure the package's import graph: modules, internal arrows, cycles and layer violations (stdlib ast only).

    python scripts/import_graph.py [package dir]     # default: xsa_lm

An arrow A -> B means module A imports module B (at the top or inside a function). Layers are listed low to high:
a module may import its own layer and the ones below it. tests/test_layering.py holds the same rules as a test.
"""

import argparse
import ast
from pathlib import Path

# Low to high: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("xsa_lm", "xsa_lm.compat", "xsa_lm.errors", "xsa_lm.locking", "xsa_lm.records"),
    ("xsa_lm.stats",),  # pure functions on numbers (numpy, scipy): the sweep's, the scaling study's statistics
    ("xsa_lm.tracking", "xsa_lm.reporting"),  # W&B and CSV loggers; the reports' formats, tables, W&B report run
    ("xsa_lm.model",),
    ("xsa_lm.config",),
    ("xsa_lm.data",),
    ("xsa_lm.checkpoints",),
    ("xsa_lm.analysis",),  # the attention diagnostics run inside training too (train.callbacks)
    ("xsa_lm.train",),
    ("xsa_lm.eval", "xsa_lm.export", "xsa_lm.bench"),
    ("xsa_lm.sweep",),
    ("xsa_lm.scale",),
    ("xsa_lm.cli",),
)
# May import the CLI and the runner: the commands, and a sweep trial's submitit job (it runs `xsa-lm train` itself).
ENTRY_POINTS = ("xsa_lm.cli", "xsa_lm.train.run", "xsa_lm.train.__main__", "xsa_lm.sweep.jobs")
NOT_TO_BE_IMPORTED = ("xsa_lm.cli", "xsa_lm.train.run")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports; `from a import b` counts a.b when b is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {name: imports_of(path, name, set(paths)) for name, path in paths.items()}


def layer_of(module: str) -> int:
    best, level = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    return level


def cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(arrows[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def into_entry_points(arrows: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (a, b) for a, targets in arrows.items() for b in targets if b in NOT_TO_BE_IMPORTED and a not in ENTRY_POINTS
    )


def upward(arrows: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows from a lower layer to a higher one."""
    return sorted((a, b) for a, targets in arrows.items() for b in targets if layer_of(a) < layer_of(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", type=Path, nargs="?", default=Path("xsa_lm"), help="the package folder")
    root = parser.parse_args().package
    if not (root / "__init__.py").is_file():  # else nothing is measured and every count reads 0: a pass
        parser.error(f"{root} is not a package folder (no __init__.py); run it from the repository root")
    arrows = graph(root)
    print(f"modules: {len(arrows)}")
    print(f"internal import arrows: {sum(len(t) for t in arrows.values())}")
    found = cycles(arrows)
    print(f"cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    entry = into_entry_points(arrows)
    print(f"arrows into {' / '.join(NOT_TO_BE_IMPORTED)} from other modules: {len(entry)}")
    for a, b in entry:
        print(f"  {a} -> {b}")
    up = upward(arrows)
    print(f"layer violations (lower -> higher): {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")


if __name__ == "__main__":
    main()
