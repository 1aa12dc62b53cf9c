"""The package's layering, checked on the source with `ast` (torchtune keeps the same rule with a test): a library
module never imports an entry module. Entries (`*/run.py`, `*_run.py`, `cli.py`, `__main__.py`: any module that
defines a `main`) parse arguments and print; everything they do lives in a library the on-policy driver, the demo,
the benchmarks and the tests call too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
ENTRY_NAMES = ("run.py", "cli.py", "__main__.py")
# Entries a library may still import (the one place to loosen, with the reason); every stage is split by now.
ALLOWED_ENTRIES: frozenset[str] = frozenset()
# Third-party packages slow enough to import that a module may import them, or a project module importing them at
# its top, inside the function that needs them: `gkd --help`, config loading and the store stay fast.
HEAVY = frozenset({"vllm", "megatron", "transformers", "reasoning_gym", "matplotlib", "torch", "peft", "datasets",
                   "numba", "triton", "safetensors"})
# In-function imports of light project modules kept on purpose: importer -> imported, and why.
LAZY_ON_PURPOSE: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def defines_main(path: Path) -> bool:
    """A module-level `def main` (the command's function) makes a module an entry, whatever its name."""
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "main"
               for n in ast.parse(path.read_text(), str(path)).body)


def entry_modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py") if p.name in ENTRY_NAMES or defines_main(p)}


def imported(path: Path, *, top_level: bool = False, modules: set[str] | None = None) -> set[str]:
    """Every module an import statement of `path` names, at any depth (function-level imports included), or with
    `top_level` only those the module runs when it is imported (its body, also under `if`/`try`); `from A import B`
    names A and A.B, since B may be a module. Given the set of `modules` there are, it names A.B where that is one
    of them, else A (B is then a name A defines)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nodes = ([n for stmt in tree.body for n in (ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt])]
             if top_level else ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                root = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*root, *([base] if base else [])])
            if modules is None:
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
            else:
                out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return out


def test_entries_are_where_the_rule_says():
    entries = entry_modules()
    assert {"pipeline.cli", "pipeline.__main__", "pipeline.generate.run", "pipeline.train.run",
            "pipeline.onpolicy.run", "pipeline.slurm.cli", "pipeline.generate.import_run", "pipeline.train.export_run",
            "pipeline.demo_run", "pipeline.slurm.local_run"} <= entries
    # every entry is named as one, so a reader knows it from the file name
    named = {m for m in entries if m.rpartition(".")[2] in ("run", "cli", "__main__") or m.endswith("_run")}
    assert entries == named, f"entries not named *run.py / cli.py: {sorted(entries - named)}"
    assert ALLOWED_ENTRIES <= entries  # an allowance for a module that is no longer an entry is stale: drop it


def test_no_library_module_imports_an_entry_module():
    forbidden = entry_modules() - ALLOWED_ENTRIES
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if module_name(path) in forbidden:
            continue
        bad += [f"{path.relative_to(PACKAGE.parent)} imports {m}" for m in sorted(imported(path) & forbidden)]
    assert not bad, "library modules importing entry modules:\n" + "\n".join(bad)


def test_project_imports_sit_at_module_top_unless_heavy():
    """An in-function import of one of our modules is allowed only where importing it at the top would pull in a
    heavy third-party package (see HEAVY) the importer does not import already, or where LAZY_ON_PURPOSE says why."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    top = {name: imported(p, top_level=True) for name, p in paths.items()}
    heavy: dict[str, bool] = {}

    def is_heavy(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name not in heavy:
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # packages run first
            deps = [m for m in top.get(name, set()) | set(parents) if m in paths and m != name and m not in seen]
            heavy[name] = any(m.split(".")[0] in HEAVY for m in top.get(name, set())) or any(
                is_heavy(m, seen | {name}) for m in deps)
        return heavy[name]

    bad = []
    for name, path in sorted(paths.items()):
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline")):
                    continue
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                           for a in node.names]
                for target in targets:
                    if (name, target) in LAZY_ON_PURPOSE or target not in paths:
                        continue
                    if not is_heavy(target) or is_heavy(name) and _same_heavy(top[name], top[target]):
                        bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {target} in {fn.name}()")
    assert not bad, "move these imports to the module top (or give the reason in LAZY_ON_PURPOSE):\n" + "\n".join(bad)


def _same_heavy(importer: set[str], target: set[str]) -> bool:
    """The importer already imports at its top every heavy package the target does directly: nothing to save."""
    heavy_of = {m.split(".")[0] for m in target if m.split(".")[0] in HEAVY}
    return bool(heavy_of) and heavy_of <= {m.split(".")[0] for m in importer}


def test_no_import_cycle():
    """The package's modules import in one direction: no module reaches itself through imports, those inside
    functions and under TYPE_CHECKING included (a circle held apart by an in-function import is still a circle)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: sorted(m for m in imported(path, modules=set(paths)) if m in paths and m != name)
             for name, path in paths.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in graph[name]:
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# The package's rooms from the ground floor up: a module imports its own room and the rooms of the layers below it,
# never a room beside it or above it (imports inside functions and under TYPE_CHECKING included). A room is the
# longest prefix here that names a module; the three stages sit side by side and meet only in files on disk.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pipeline.assets", "pipeline.lifetime", "pipeline.logs", "pipeline.pause"),
    ("pipeline.errors", "pipeline"),
    ("pipeline.config",),
    ("pipeline.store",),
    ("pipeline.engine", "pipeline.slurm"),
    ("pipeline.ray",),
    ("pipeline.generate", "pipeline.score", "pipeline.train"),
    ("pipeline.evaluate",),
    ("pipeline.onpolicy", "pipeline.demo"),
    ("pipeline.cli",),
    ("pipeline.__main__", "pipeline.demo_run"),
)
# The trainer's rooms, the same rule one floor down: the losses know nothing of the trainer, the data path knows the
# losses' helpers only, the students and the live teachers read micro-batches, the config's validation calls each
# rule's owner, and the loop sits on top.
TRAIN_LAYERS: tuple[tuple[str, ...], ...] = (
    ("pipeline.train.losses", "pipeline.train"),
    ("pipeline.train.data",),
    ("pipeline.train.parallel",),
    ("pipeline.train.teacher",),
    ("pipeline.train.models",),
    ("pipeline.train.config",),
    ("pipeline.train.checkpoint", "pipeline.train.metrics"),
    ("pipeline.train.setup", "pipeline.train.step"),
    ("pipeline.train.loop", "pipeline.train.export"),
    ("pipeline.train.run", "pipeline.train.export_run"),
)
# The score stage's rooms: the config and its errors below everything that reads them, the served client's
# pieces under the client, the orchestration (scorer) on top.
SCORE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("pipeline.score.served.access", "pipeline.score.served.probe", "pipeline.score.errors", "pipeline.score.writer",
     "pipeline.score.adapter", "pipeline.score", "pipeline.score.served"),
    ("pipeline.score.config", "pipeline.score.served.logprobs"),
    ("pipeline.score.numerics", "pipeline.score.tokenizers", "pipeline.score.extract", "pipeline.score.served.client",
     "pipeline.score.teacher"),
    ("pipeline.score.hidden",),
    ("pipeline.score.rows", "pipeline.score.parts"),
    ("pipeline.score.scorer",),
    ("pipeline.score.run",),
)
def room(name: str, layers: tuple[tuple[str, ...], ...]) -> tuple[int, str] | None:
    """(layer, room) of module `name`: the longest room that is `name` or a package above it. A room that is a
    package above other rooms of the same table (a package's __init__, e.g. `pipeline.score` in SCORE_LAYERS) names
    only itself, so a module placed in no room is reported, not swept into its package's room."""
    every = {r for rooms in layers for r in rooms}
    packages = {r for r in every if any(o.startswith(r + ".") for o in every)}
    found = [(len(r), i, r) for i, rooms in enumerate(layers) for r in rooms
             if name == r or name.startswith(r + ".") and r not in packages]
    return max(found)[1:] if found else None


def downward_problems(graph: dict[str, list[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    bad = []
    for name, deps in sorted(graph.items()):
        here = room(name, layers)
        for dep in deps:
            there = room(dep, layers)
            if here is None or there is None or here[1] == there[1]:
                continue
            if there[0] >= here[0]:
                bad.append(f"{name} ({here[1]}) imports {dep} ({there[1]}): "
                           + ("a room beside it" if there[0] == here[0] else "a room above it"))
    return bad


def test_rooms_import_downwards_only():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: sorted(m for m in imported(path, modules=set(paths)) if m in paths and m != name)
             for name, path in paths.items()}
    unplaced = sorted(n for n in graph if room(n, LAYERS) is None)
    assert not unplaced, f"modules in no room of LAYERS (place them): {unplaced}"
    train = {n: d for n, d in graph.items() if n.startswith("pipeline.train")}
    unplaced = sorted(n for n in train if room(n, TRAIN_LAYERS) is None)
    assert not unplaced, f"trainer modules in no room of TRAIN_LAYERS (place them): {unplaced}"
    score = {n: d for n, d in graph.items() if n.startswith("pipeline.score")}
    unplaced = sorted(n for n in score if room(n, SCORE_LAYERS) is None)
    assert not unplaced, f"score modules in no room of SCORE_LAYERS (place them): {unplaced}"
    bad = (downward_problems(graph, LAYERS) + downward_problems(train, TRAIN_LAYERS)
           + downward_problems(score, SCORE_LAYERS))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_layering_check_catches_an_upward_import():
    graph = {"pipeline.train.losses.fused": ["pipeline.train.data.batch"], "pipeline.store.cache": ["pipeline.score.x"],
             "pipeline.score.scorer": ["pipeline.train.config"], "pipeline.train.data.loader": ["pipeline.store.cache"]}
    assert downward_problems(graph, TRAIN_LAYERS) == [
        "pipeline.train.losses.fused (pipeline.train.losses) imports pipeline.train.data.batch (pipeline.train.data): "
        "a room above it"]
    assert downward_problems(graph, LAYERS) == [
        "pipeline.score.scorer (pipeline.score) imports pipeline.train.config (pipeline.train): a room beside it",
        "pipeline.store.cache (pipeline.store) imports pipeline.score.x (pipeline.score): a room above it"]


# Modules over MAX_LINES, to be split (issue 46): a new long module fails the test below, and so does one of these
# once it is short enough, until it is taken off this list.
MAX_LINES = 500
KNOWN_LONG: frozenset[str] = frozenset()


def test_no_module_is_longer_than_max_lines():
    long = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {p: n for p, n in long.items() if n > MAX_LINES}
    assert set(long) == KNOWN_LONG, (f"over {MAX_LINES} lines: {dict(sorted(long.items()))}; split a new one, or take a "
                                     f"split one off KNOWN_LONG: {sorted(KNOWN_LONG - set(long))}")
