"""The package's layering, checked on the source with `ast` (torchtune keeps the same rule with a test): a library
module never imports an entry module. Entries (`*/run.py`, `cli.py`, `__main__.py`) parse arguments and print;
everything they do lives in a library the on-policy driver, the demo and the tests call too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
ENTRY_NAMES = ("run.py", "cli.py", "__main__.py")
# Entries libraries may still import, until they are split like generate/ and train/ (the one place to tighten):
# pipeline/score/run.py becomes score/scorer.py + the entry.
ALLOWED_ENTRIES = frozenset({"pipeline.score.run"})


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def entry_modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py") if p.name in ENTRY_NAMES}


def imported(path: Path) -> set[str]:
    """Every module an import statement of `path` names, at any depth (function-level imports included); `from
    A import B` names A and A.B, since B may be a module."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                root = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*root, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_entries_are_where_the_rule_says():
    entries = entry_modules()
    assert {"pipeline.cli", "pipeline.__main__", "pipeline.generate.run", "pipeline.train.run",
            "pipeline.onpolicy.run", "pipeline.slurm.cli"} <= entries
    assert ALLOWED_ENTRIES <= entries  # an allowance for a module that is no longer an entry is stale: drop it


def test_no_library_module_imports_an_entry_module():
    forbidden = entry_modules() - ALLOWED_ENTRIES
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ENTRY_NAMES:
            continue
        bad += [f"{path.relative_to(PACKAGE.parent)} imports {m}" for m in sorted(imported(path) & forbidden)]
    assert not bad, "library modules importing entry modules:\n" + "\n".join(bad)
