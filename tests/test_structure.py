"""The package keeps the shape docs/design.md draws: small files and functions, imports of its own
modules at the top of the file, and no import cycle between its modules."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "ladder"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def own_imports(tree: ast.AST, names: set[str]) -> set[str]:
    """The package's modules `tree` imports (anywhere in it)."""
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for target in targets:
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def test_files_and_functions_are_small():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}")
    assert not too_long


def test_the_package_imports_its_own_modules_at_the_top():
    inside = []
    names = set(modules())
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if own_imports(ast.Module(body=node.body, type_ignores=[]), names) - {name}:
                    inside.append(f"{name}.{node.name}")
    assert not inside


def test_no_import_cycles():
    trees = modules()
    graph = {name: own_imports(tree, set(trees)) - {name} for name, tree in trees.items()}
    reachable = {name: set() for name in graph}
    for start in graph:  # every module reachable from each: a cycle returns to its start
        stack = list(graph[start])
        while stack:
            module = stack.pop()
            if module not in reachable[start]:
                reachable[start].add(module)
                stack.extend(graph[module])
    assert not sorted(name for name in graph if name in reachable[name])


def test_experiments_readme_indexes_every_script():
    experiments = PACKAGE.parent.parent / "experiments"
    index = (experiments / "README.md").read_text()
    scripts = [p.relative_to(experiments).as_posix() for p in experiments.rglob("*") if p.suffix in (".py", ".sh")]
    assert [s for s in scripts if f"`{s}`" not in index] == []
