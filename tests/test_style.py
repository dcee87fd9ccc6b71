"""Style rules the linter cannot check: every ``# noqa`` says why the rule does not apply there."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOQA = re.compile(r"#\s*noqa(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<why>.*)$")


def test_every_noqa_says_why():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    missing = []
    for name in files.stdout.split():
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
            match = NOQA.search(line)
            if match and not re.search(r"[a-z]{3}", match["why"]):
                missing.append(f"{name}:{number}: {line.strip()}")
    assert not missing, "a # noqa without a reason after its codes:\n" + "\n".join(missing)


def test_one_version_string():
    import importlib.metadata

    import asyncvec

    assert importlib.metadata.version("asyncvec") == asyncvec.__version__
    assert "version=VERSION" in (ROOT / "setup.py").read_text()  # setup.py reads asyncvec/__init__.py's


# ---------------------------------------------------------------- rooms (../shared/DESIGN.md "Rooms")
PACKAGES = ("asyncvec", "agents", "envs")


def room_of(path: Path) -> str:
    """A room is a folder of asyncvec/ (vector, inference, lm...), a module at its top, agents/ or envs/."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return "/".join(parts[:2]) if parts[0] == "asyncvec" else parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != "asyncvec":  # agents/ and envs/ install as asyncvec.agents and asyncvec.envs
        parts.insert(0, "asyncvec")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8")) for p in PACKAGES for path in (ROOT / p).rglob("*.py")}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, variables and attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if private(name)}


def test_no_room_reaches_into_another_rooms_private_names():
    """An import of a private name or module of another room, or ``obj._name`` where only another room
    defines ``_name``: each room talks to the others through public names (DESIGN.md)."""
    trees = python_files()
    room_names: dict[str, set[str]] = {}
    for path, tree in trees.items():
        room_names.setdefault(room_of(path), set()).update(defined_private_names(tree))
    module_rooms = {module_name(path): room_of(path) for path in trees}
    everywhere = set().union(*room_names.values())
    reaches = []
    for path, tree in trees.items():
        room = room_of(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "asyncvec":
                target = module_rooms.get(node.module) or module_rooms.get(node.module.rpartition(".")[0])
                names = [a.name for a in node.names if private(a.name)]
                if any(private(part) for part in node.module.split(".")):
                    names.append(node.module)
                if target is not None and target != room and names:
                    reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {names} from {target}")
            elif isinstance(node, ast.Attribute) and private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in everywhere and node.attr not in room_names[room]:
                    reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not reaches, "reaches into another room's private names:\n" + "\n".join(reaches)


def test_no_import_circle():
    """Modules of asyncvec (agents and envs included) never import each other in a loop, not even lazily."""
    trees = python_files()
    modules = {module_name(path): path for path in trees}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(trees[path]):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name and not name.startswith(t + "."))
    # an __init__ re-exporting its modules is not a circle with them: only edges between non-package modules count
    leaves = {name for name, path in modules.items() if path.name != "__init__.py"}
    circles = []
    for start in sorted(leaves):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node] & leaves:
                if nxt == start:
                    circles.append(" -> ".join([*trail, start]))
                elif nxt not in seen and nxt > start:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not circles, "import circles:\n" + "\n".join(circles)
