"""The house rules of docs/architecture.md, checked over the source tree (no imports run).

Every module belongs to a room; arrows point down only: readers and producers import the
contract, never each other; nothing but the roof (the CLI) imports the roof; and the words both
sides must agree on (span names, attribute keys, table columns, counter names, environment
variables) are defined in the contract alone.
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from functools import cache
from pathlib import Path

from kvscope.contract import counters, env, rundir, semconv

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvscope"
CONTRACT = "contract"
READER = "reader"
PRODUCER = "producer"
ROOF = "roof"
TESTKIT = "testkit"
# room -> side; every room (a link kvscope/<room> -> ../<room>) has exactly one, the rest of
# kvscope/ is the roof
SIDES = {
    "contract": CONTRACT,
    "analysis": READER, "dashboards": READER, "exports": READER,
    "tracer": PRODUCER, "probes": PRODUCER, "patched_backend": PRODUCER, "capture": PRODUCER,
    "testkit": TESTKIT,
}
MAY_IMPORT = {
    CONTRACT: {CONTRACT},
    READER: {CONTRACT, READER},
    PRODUCER: {CONTRACT, PRODUCER},
    ROOF: {CONTRACT, READER, PRODUCER, ROOF},
    TESTKIT: {CONTRACT, READER, PRODUCER, TESTKIT},
}


def rooms() -> dict[str, Path]:
    """The one list of rooms: each link kvscope/<room> -> ../<room>, as room name -> folder."""
    return {link.name: link.resolve() for link in PACKAGE.iterdir() if link.is_symlink()}


@cache
def modules() -> dict[str, Path]:
    """Every installed module name -> its file, walking kvscope/ through the room links."""
    found = {}
    for folder, _, names in os.walk(PACKAGE, followlinks=True):
        for name in names:
            if name.endswith(".py"):
                parts = Path(folder, name).relative_to(PACKAGE).with_suffix("").parts
                module = ".".join(("kvscope", *parts[:-1 if parts[-1] == "__init__" else None]))
                found[module] = Path(folder, name).resolve()
    return found


def room(module: str) -> str:
    """The room of a module: its package below kvscope (kvscope.tracer, ...) or kvscope.<x>."""
    parts = module.split(".")
    return ".".join(parts[:2])


def side(module: str) -> str | None:
    if not (module == "kvscope" or module.startswith("kvscope.")):
        return None
    return SIDES.get(module.split(".")[1], ROOF) if "." in module else ROOF


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if modules()[importer].name != "__init__.py":
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def edges() -> frozenset[tuple[str, str]]:
    """(importer, imported module) for every import of kvscope's own modules, anywhere in a
    file (imports inside functions count: they are arrows too)."""
    known = modules()
    out = set()
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            else:
                continue
            out.update((name, t) for t in targets if t == "kvscope" or t.startswith("kvscope."))
    return frozenset(out)


def arrow_counts() -> Counter[tuple[str, str]]:
    """Import edges between rooms, by direction (the numbers docs/architecture.md quotes)."""
    return Counter((room(a), room(b)) for a, b in edges() if room(a) != room(b))


def test_every_room_is_linked_into_the_package_and_has_a_side():
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"kvscope"}
    assert set(rooms()) == folders == set(SIDES)
    assert all(folder == ROOT / name for name, folder in rooms().items())


def test_every_module_has_a_room_and_side():
    assert [m for m in modules() if side(m) is None] == []


def test_arrows_point_down_only():
    wrong = sorted(f"{a} ({side(a)}) imports {b} ({side(b)})" for a, b in edges()
                   if side(b) not in MAY_IMPORT[side(a)])
    assert wrong == []


def test_the_package_root_imports_nothing():
    """Every `import kvscope.x` runs kvscope/__init__.py first: it must stay empty of imports,
    or the contract would not be the ground floor."""
    assert [b for a, b in edges() if a == "kvscope"] == []


def test_no_module_outside_the_installed_rooms_is_imported():
    assert sorted({b for _, b in edges() if b not in modules()
                   and b.rpartition(".")[0] not in modules()}) == []


def test_the_study_makes_runs_and_leaves_reading_them_to_the_readers():
    """kvscope/study.py plans, makes and records a study's runs and analyses each one as
    `kvscope analyze` does; every table, verdict or line read from the finished runs is
    analysis/study_*'s (docs/architecture.md), so a dashboard or CI reads a study without the
    CLI. Reading runs into tables takes pandas and the readers' modules: the study uses neither."""
    readers = {b for a, b in edges() if a == "kvscope.study" and side(b) == READER}
    assert readers == {"kvscope.analysis.outputs"}
    tree = ast.parse(modules()["kvscope.study"].read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "pandas" not in imported


def _vocabularies() -> dict[str, frozenset[str]]:
    values = {k: v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}
    words = {
        "span name or kvscope attribute key": frozenset(
            v for k, v in values.items() if k.startswith(("SPAN_", "EVENT_"))
            or v.startswith("kvscope.")),
        "environment variable": frozenset(v for k, v in vars(env).items() if k.startswith("ENV_")),
    }
    lists = {"span columns": frozenset(semconv.SPAN_COLUMNS),
             "disk backend counters": frozenset(counters.DISK_BACKEND_COUNTERS)}
    lists.update({f"{name} columns": frozenset(spec.columns)
                  for name, spec in rundir.TABLES.items()})
    return {"words": words, "lists": lists}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _string_items(value: ast.AST) -> list[str] | None:
    items = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", None)
    if not isinstance(value, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or items is None:
        return None
    strings = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
    return strings if len(strings) == len(items) else None


def redefinitions(path: Path) -> list[str]:
    """Contract words spelt out in `path`: a span name, kvscope attribute key or contract
    variable as a string literal, or a collection literal of >= 3 table columns or counter names
    that all belong to one contract list (a copy of it)."""
    vocab = _vocabularies()
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += [f"{where}:{node.lineno}: {kind} {node.value!r}"
                      for kind, words in vocab["words"].items() if node.value in words]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            strings = _string_items(node.value)
            if strings is None or len(strings) < 3:
                continue
            found += [f"{where}:{node.lineno}: a copy of the {kind}"
                      for kind, words in vocab["lists"].items() if set(strings) <= words]
    return found


def test_contract_words_are_defined_only_in_the_contract():
    assert [line for module, path in sorted(modules().items()) if side(module) != CONTRACT
            for line in redefinitions(path)] == []


def test_the_check_finds_a_copied_span_name_and_column_list(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text(f'NAME = "{semconv.SPAN_STORAGE_READ}"\n'
                    f'COLUMNS = {tuple(rundir.TABLES["block_io"].columns[:4])!r}\n')
    assert len(redefinitions(copy)) == 2


def test_no_two_rooms_import_each_other():
    """A loop between rooms (the backend's tuner importing capture, which imports the backend)
    makes neither one usable without the other: shared code goes down to the lower room."""
    arrows = arrow_counts()
    assert sorted(f"{a} <-> {b}" for a, b in arrows if a < b and (b, a) in arrows) == []


def test_one_import_style_in_every_room():
    """The house groups imports by blank lines alone (standard library, third party, kvscope),
    plain imports before from-imports; LMCache's marker comments were a second style."""
    markers = ("# Standard", "# Third Party", "# First Party")  # at any indent
    assert sorted(f"{path.relative_to(ROOT)}:{n}" for path in modules().values()
                  if path.is_relative_to(ROOT)
                  for n, line in enumerate(path.read_text().splitlines(), 1)
                  if line.strip() in markers) == []
