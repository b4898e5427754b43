"""JSON that another process wrote, read as a privileged reader may: through
`contract.files.read_bytes` (a regular file of an expected owner, not a link, size-capped) and
of a declared shape (a JSON Schema), so a file of any other shape is refused in one line naming
the file and the field, never summed or indexed into a traceback.

jsonschema is imported on first use (about 0.2 s): the serving processes that write these
files never read them.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

from kvscope.contract import files


def shape_problem(document: Any, schema: Mapping[str, Any]) -> str | None:
    """`field: what is wrong` for the most relevant way `document` breaks `schema`, or None."""
    return next(iter(shape_problems(document, schema)), None)


def shape_problems(document: Any, schema: Mapping[str, Any]) -> list[str]:
    """Every way `document` breaks `schema`, one `field: what is wrong` line each, by field."""
    import jsonschema

    errors = jsonschema.Draft202012Validator(schema).iter_errors(document)
    return [f"field {'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}"
            for e in sorted(errors, key=lambda e: list(map(str, e.absolute_path)))]


def read_json(path: str | os.PathLike[str], max_bytes: int, schema: Mapping[str, Any],
              owners: Iterable[int] | None = None) -> Any:
    """The document in `path`; ValueError (UnsafePath for the file itself) in one line naming
    the file and what is wrong with it. FileNotFoundError passes through (a file replaced
    between listing and reading)."""
    return parse_json(path, files.read_bytes(path, max_bytes, owners), schema)


def parse_json(path: str | os.PathLike[str], data: bytes, schema: Mapping[str, Any]) -> Any:
    """The document `data` (the contents of `path`, read by the caller); ValueError in one
    line naming the file and what is wrong with it."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not JSON kvscope can read ({e})") from None
    problem = shape_problem(document, schema)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    return document


def read_json_files(paths: Iterable[str | os.PathLike[str]], max_bytes: int,
                    schema: Mapping[str, Any], owners: Iterable[int] | None = None
                    ) -> tuple[list[Any], list[str]]:
    """(the documents of `paths` that `read_json` accepts, one line per file refused); a file
    gone meanwhile (replaced whole by its writer) is skipped."""
    documents, refused = [], []
    for path in paths:
        try:
            documents.append(read_json(path, max_bytes, schema, owners))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            refused.append(str(e))
    return documents, refused
