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
    text = p.read_text()
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise error(f"{what} {p} is not valid JSON: {err}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise error(f"{what} {p} is not valid YAML{where}: {problem}") from None


def format_validation_error(err: ValidationError, header: str, docs: str) -> str:
    """Every bad field, on one line: its dotted path and what to write instead."""
    items = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
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
