"""Reading the files users write (clusters, catalogues, profiles, plans), with one
set of error messages: a missing file, broken YAML/JSON and invalid fields all say
which file, which field and what to do. Every file model derives from `Strict` and is
read through `validate_file`, so every file speaks the same way about its mistakes."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import UserError


class Strict(BaseModel):
    """The base of every model read from a user's file: an unknown key is a mistake
    (a misspelt field must not be silently ignored), and values never change once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def read_structured(path: str | Path, what: str, error: type[UserError] = UserError) -> object:
    """Parse a YAML (or, by suffix, JSON) file; `what` names it in errors ("cluster file")."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} does not exist")
    text = read_text(p, what, error)
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise error(f"{what} {p} is not valid JSON: {_first_line(err)}") from None
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as err:
        # ValueError: YAML scalars the resolver accepts but Python cannot build (e.g. out-of-range dates)
        why = yaml_problem(err) if isinstance(err, yaml.YAMLError) else f": {_first_line(err)}"
        raise error(f"{what} {p} is not valid YAML{why}") from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line, where and what (` at line L, column C: problem`);
    PyYAML's own text spans several lines, with a copy of the offending line."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: {problem}"


def read_text(path: Path, what: str, error: type[UserError] = UserError) -> str:
    """A user's text file as str; bytes that are not UTF-8 are named by offset."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what} {path} is not UTF-8 text (byte {err.start}: {err.object[err.start:err.start + 1]!r}); "
                    "save it as UTF-8") from None
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror}") from None


def _first_line(err: BaseException) -> str:
    return "nested too deeply" if isinstance(err, RecursionError) else str(err).splitlines()[0]


def format_validation_error(err: ValidationError, header: str, docs: str) -> str:
    """Every bad field, on one line: its dotted path and what to write instead."""
    items = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            msg = f"unknown key {e['loc'][-1]!r}; check its spelling against {docs}"
        elif e["type"] == "missing":
            msg = f"required; add it (see {docs})"
        items.append(f"{loc}: {msg}")
    return f"{header} {' | '.join(items)}"


def validate_file(model: type[BaseModel], data: object, *, what: str, source: str, docs: str,
                  error: type[UserError] = UserError, expected: str = "a mapping"):
    """`data` (parsed YAML/JSON) as `model`; any mistake raises `error` naming `source`
    and every bad field's path (`invalid catalogue aws.yaml: types.0.memory: ...`)."""
    if not isinstance(data, dict):
        raise error(f"invalid {what} {source}: expected {expected}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise error(format_validation_error(err, f"invalid {what} {source}:", docs)) from None
