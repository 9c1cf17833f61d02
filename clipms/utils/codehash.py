"""Which project code a module runs, found by reading it, and a digest of what that code computes.

`module_closure("clipms.train.job", root)` follows every `import` statement (top-level or inside a
function: lazy imports run too) from a module to the modules of the given packages it reaches
(the library's own by default), transitively, parent packages' `__init__.py` included when they
hold code (they run on import). Nothing is imported, so it works on code that cannot run here.
The training checkpoint fingerprint hashes the closure of the training code; the pipeline's tests
pass the project's packages (pyproject.toml names them) to check dvc.yaml's code dependencies and
the import graph, so none of them can go stale by hand.

`code_digest(files, root)` hashes each file's syntax tree without docstrings: a comment or a
docstring edit leaves it unchanged (it cannot change a result), any change to code changes it.
"""

# tested by: tests/project/test_dvc_deps.py

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

LIBRARY = ("clipms",)


def module_closure(entry: str, root: Path | str,
                   packages: Iterable[str] = LIBRARY) -> list[Path]:
    """Files (relative to `root`, sorted) of module `entry` and every module of `packages` it
    imports."""
    root = Path(root)
    packages = tuple(packages)
    seen: set[Path] = set()
    # A module is imported from many files, and every module of a package looks at the package's
    # __init__.py: find each name, and read each file, once per closure.
    looked_up: set[str] = set()
    runs_nothing: dict[Path, bool] = {}
    pending = [entry]
    while pending:
        module = pending.pop()
        if module in looked_up:
            continue
        looked_up.add(module)
        for path in _module_files(module, root, packages, runs_nothing):
            if path not in seen:
                seen.add(path)
                pending.extend(imported_modules(path, root))
    return sorted(seen)


def code_digest(files: Iterable[Path | str], root: Path | str) -> str:
    """sha256 (hex) over the docstring-free syntax trees of `files`, keyed by their paths."""
    digest = hashlib.sha256()
    for name in sorted(str(Path(f)) for f in files):
        tree = _strip_docstrings(ast.parse((Path(root) / name).read_text(), name))
        digest.update(name.encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return digest.hexdigest()


def _module_files(module: str, root: Path, packages: tuple[str, ...],
                  runs_nothing: dict[Path, bool]) -> list[Path]:
    """The file of `module` and the `__init__.py` of each package above it (empty if external);
    `runs_nothing` remembers which files hold no code."""
    parts = module.split(".")
    if parts[0] not in packages:
        return []
    found = []
    for depth in range(1, len(parts) + 1):
        base = Path(*parts[:depth])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if (root / candidate).is_file():
                if candidate not in runs_nothing:
                    runs_nothing[candidate] = _runs_nothing(root / candidate)
                if not runs_nothing[candidate]:
                    found.append(candidate)
                break
        else:
            break  # an attribute of the package (`from clipms import __version__`), not a module
    return found


def _runs_nothing(path: Path) -> bool:
    """A file with at most a docstring (a package's `__init__.py`, typically). Only the top level
    is looked at: this runs for every module an import reaches, and walking each whole tree made
    the closures of the stages cost seconds."""
    body = ast.parse(path.read_text(), str(path)).body
    if body and _is_docstring(body[0]):
        body = body[1:]
    return all(isinstance(node, ast.Pass) for node in body)


def imported_modules(path: Path, root: Path) -> list[str]:
    """Every module name an import statement in `path` may load (`from a import b` -> a, a.b)."""
    tree = ast.parse((root / path).read_text(), str(path))
    package = ".".join(path.with_suffix("").parts[:-1] if path.name != "__init__.py"
                       else path.parent.parts)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _absolute(module: str | None, level: int, package: str) -> str:
    if level == 0:
        return module or ""
    anchor = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*anchor, *([module] if module else [])])


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.body and _is_docstring(node.body[0]):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
        and isinstance(statement.value.value, str)
