"""Rewrite old top-level imports to the one `kvscope.` namespace (issue 11); safe to re-run.

    .venv/bin/python scripts/namespace_imports.py [--check] [PATH ...]

kvscope's rooms stay top-level folders (tracer/, probes/, ...) but install as kvscope.tracer,
kvscope.probes, ... (pyproject's package-dir), and the run-directory contract lives in
contract/ (kvscope.contract). This rewrites, in .py files, every import of an old name and every
quoted dotted path that names one of our modules (entry points, LMCache module paths, logger
names, mock targets), and in docs the dotted module names and moved file paths. A branch that
still imports `tracer` or `kvscope.rundir` is fixed by running it again. `--check` only lists
the files it would change (exit 1 if any).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("tracer", "probes", "analysis", "dashboards", "patched_backend")
# old module -> new module, most specific first (modules that moved to another room)
MOVED = {
    "kvscope.rundir": "kvscope.contract.rundir",
    "kvscope.clock": "kvscope.contract.clock",
    "tracer.semconv": "kvscope.contract.semconv",
    "tracer.perfetto": "kvscope.exports.perfetto",
    "tracer.merge": "kvscope.exports.merge",
    "analysis.synthetic_write": "kvscope.testkit.synthetic_write",
    "analysis.synthetic": "kvscope.testkit.synthetic",
    **{room: f"kvscope.{room}" for room in ROOMS},
}
MOVED_FILES = {
    "kvscope/rundir.py": "contract/rundir.py", "kvscope/clock.py": "contract/clock.py",
    "tracer/semconv.py": "contract/semconv.py", "tracer/perfetto.py": "exports/perfetto.py",
    "tracer/merge.py": "exports/merge.py", "analysis/synthetic.py": "testkit/synthetic.py",
    "analysis/synthetic_write.py": "testkit/synthetic_write.py",
}
SKIP = (".venv", ".git", "build", "tests/analysis/data", "tests/probes/data", "contract",
        "scripts/namespace_imports.py",
        "bench/dashboard_render.py")  # imports the old names on purpose, for older revisions
# a dotted name of ours: a room and at least one module below it, or a moved kvscope module
# (a bare room name is left alone: "analysis", "tracer", "probes" are also manifest sections)
_DOTTED = r"(?:(?:%s)(?:\.\w+)+|(?:kvscope\.rundir|kvscope\.clock)\b(?:\.\w+)*)" % "|".join(ROOMS)
EMBEDDED = re.compile(r"^\s*(from\s+(%s)[\w.]*\s+import\s|import\s+(%s)\b)" % (
    "|".join(ROOMS + ("kvscope",)), "|".join(ROOMS)))
STRING_FROM = re.compile(r"""(?<=["'])from ((?:%s)(?:\.\w+)*) import""" % "|".join(ROOMS))
QUOTED = re.compile(r"""(?<=["'])(%s)(?=[:"'])""" % _DOTTED)
DOTTED_IN_DOCS = re.compile(r"(?<![\w/.\-])(%s)(?![\w/])" % _DOTTED)


def new_name(module: str) -> str | None:
    """The new name of `module` (or of the module an attribute path starts with), else None."""
    for old, new in MOVED.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return None


def is_ours(dotted: str) -> bool:
    """True when `dotted` (a module, or module.attribute) names a module of the old tree: a
    file that exists below a room, or one that moved."""
    if any(dotted == m or dotted.startswith(m + ".") for m in MOVED if "." in m):
        return True
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:cut])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return True
    return False


def _split_from(module: str, names: list[ast.alias]) -> list[tuple[str, list[ast.alias]]]:
    """`from module import a, b`: the (new module, names) statements it becomes (a name that
    is itself a moved module, as `from kvscope import rundir`, goes to its new package)."""
    groups: dict[str, list[ast.alias]] = {}
    for alias in names:
        target = new_name(f"{module}.{alias.name}")
        moved_submodule = target is not None and f"{module}.{alias.name}" in MOVED
        home = target.rpartition(".")[0] if moved_submodule else (new_name(module) or module)
        groups.setdefault(home, []).append(alias)
    return list(groups.items())


def _render(indent: str, module: str, names: list[ast.alias]) -> str:
    parts = [a.name if a.asname is None else f"{a.name} as {a.asname}" for a in names]
    line = f"{indent}from {module} import {', '.join(parts)}"
    if len(line) <= 100:
        return line
    body = ",\n".join(f"{indent}    {p}" for p in parts)
    return f"{indent}from {module} import (\n{body},\n{indent})"


def rewrite_python(text: str) -> str:
    """`text` with every import of an old name and every quoted old module path rewritten."""
    lines = [_embedded_import(line) for line in _imports(text).splitlines(keepends=True)]
    text = STRING_FROM.sub(lambda m: f"from {new_name(m.group(1))} import", "".join(lines))
    return QUOTED.sub(lambda m: _quoted(m.group(1)), text)


def _imports(text: str) -> str:
    """`text` with its import statements of old names rewritten."""
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line, replacement) 0-based
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            groups = _split_from(node.module, node.names)
            if [m for m, _ in groups] == [node.module]:
                continue
            if len(groups) == 1:  # a plain rename keeps the statement's own layout
                first = lines[node.lineno - 1]
                edits.append((node.lineno - 1, node.lineno - 1, re.sub(
                    rf"\bfrom\s+{re.escape(node.module)}\s+import", f"from {groups[0][0]} import",
                    first, count=1)))
                continue
            indent = lines[node.lineno - 1][:node.col_offset]
            tail = lines[node.end_lineno - 1][node.end_col_offset:]
            body = "\n".join(_render(indent, m, n) for m, n in groups)
            edits.append((node.lineno - 1, node.end_lineno - 1, body + tail))
        elif isinstance(node, ast.Import):
            if not any(new_name(a.name) for a in node.names):
                continue
            indent = lines[node.lineno - 1][:node.col_offset]
            tail = lines[node.end_lineno - 1][node.end_col_offset:]
            out = []
            for a in node.names:
                new = new_name(a.name)
                if new is None:
                    out.append(f"{indent}import {a.name}" + (f" as {a.asname}" if a.asname else ""))
                elif a.asname or "." in a.name:  # `import tracer.x as p` keeps its binding
                    out.append(f"{indent}import {new} as {a.asname or a.name.split('.')[0]}"
                               if a.asname else f"{indent}import {new}")
                else:  # `import analysis` binds `analysis`
                    package, _, leaf = new.rpartition(".")
                    out.append(f"{indent}from {package} import {leaf}")
            edits.append((node.lineno - 1, node.end_lineno - 1, "\n".join(out) + tail))
    for first, last, replacement in sorted(edits, reverse=True):
        lines[first:last + 1] = [replacement]
    return "".join(lines)


def _embedded_import(line: str) -> str:
    """A one-line import inside a string (a script a test runs with `python -c`)."""
    if not EMBEDDED.match(line):
        return line
    indent, statement = line[:len(line) - len(line.lstrip())], line.strip()
    try:
        body = _imports(statement + "\n")
    except SyntaxError:  # not a whole statement (a parenthesised import's first line)
        return line
    if body == statement + "\n":
        return line
    return "".join(indent + part for part in body.splitlines(keepends=True)).rstrip("\n") + (
        "\n" if line.endswith("\n") else "")


def _quoted(dotted: str) -> str:
    if not is_ours(dotted):
        return dotted
    return new_name(dotted) or dotted


def rewrite_doc(text: str) -> str:
    """Docs: moved file paths, imports in code blocks, dotted names of our modules."""
    for old, new in MOVED_FILES.items():
        text = re.sub(rf"(?<![\w/]){re.escape(old)}", new, text)
    text = "".join(_embedded_import(line) for line in text.splitlines(keepends=True))
    return DOTTED_IN_DOCS.sub(lambda m: _quoted(m.group(1)), text)


def targets(paths: list[str]) -> list[Path]:
    roots = [ROOT / p for p in paths] if paths else [ROOT]
    found = []
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if any(rel == s or rel.startswith(s + "/") for s in SKIP) or not f.is_file():
                continue
            if f.suffix in (".py", ".md", ".yaml", ".yml", ".sh") or f.name == "Makefile":
                found.append(f)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list, do not write")
    parser.add_argument("paths", nargs="*", help="files or folders (default: the whole tree)")
    args = parser.parse_args(argv)
    changed = []
    for path in targets(args.paths):
        text = path.read_text()
        new = rewrite_python(text) if path.suffix == ".py" else rewrite_doc(text)
        if new != text:
            changed.append(path.relative_to(ROOT).as_posix())
            if not args.check:
                path.write_text(new)
    for name in changed:
        print(name)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
