"""Reading the files users write (clusters, catalogues, profiles, plans), with one
set of error messages: a missing file, broken YAML/JSON and invalid fields all say
which file, which field and what to do. Every file model derives from `Strict` and is
read through `validate_file`, so every file speaks the same way about its mistakes."""
from __future__ import annotations

import json
import typing
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


_BOUNDS = {"greater_than": ("gt", "above"), "greater_than_equal": ("ge", "at least"),
           "less_than": ("lt", "below"), "less_than_equal": ("le", "at most")}


def _inner_model(annotation: object) -> type[BaseModel] | None:
    """The model a field holds, through Optional/tuple/list (None: a plain value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def field_hint(model: type[BaseModel], loc: tuple) -> str | None:
    """The `hint` a field declares (`Field(json_schema_extra={"hint": ...})`): how to
    write it, said after the mistake instead of pydantic's generic wording."""
    current: type[BaseModel] | None = model
    hint = None
    for part in loc:
        if isinstance(part, int):
            continue
        info = current.model_fields.get(str(part)) if current is not None else None
        if info is None:
            return None
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        hint = extra.get("hint")
        current = _inner_model(info.annotation)
    return hint


def _message(e: dict, docs: str) -> str:
    """One mistake in the user's terms: what was written, what to write instead."""
    if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"unknown key {e['loc'][-1]!r}; check its spelling against {docs}"
    if e["type"] == "missing":
        return f"required; add it (see {docs})"
    if e["type"] in _BOUNDS:
        key, words = _BOUNDS[e["type"]]
        return f"{e.get('input')!r} is out of range; write a number {words} {e.get('ctx', {}).get(key)}"
    if e["type"] in ("float_parsing", "int_parsing", "float_type", "int_type"):
        kind = "a whole number" if e["type"].startswith("int") else "a number"
        return f"{e.get('input')!r} is not {kind}; write {kind} (e.g. 1{'.0' if kind == 'a number' else ''})"
    return e["msg"].removeprefix("Value error, ")


def format_validation_error(err: ValidationError, header: str, docs: str,
                            model: type[BaseModel] | None = None) -> str:
    """Every bad field, on one line: its dotted path, what is wrong and what to write
    instead (with the field's own `hint` where `model` declares one)."""
    items = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = _message(e, docs)
        hint = field_hint(model, e["loc"]) if model is not None and e["type"] not in (
            "extra_forbidden", "unexpected_keyword_argument", "missing") else None
        items.append(f"{loc}: {msg}" + (f" ({hint})" if hint else ""))
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
        raise error(format_validation_error(err, f"invalid {what} {source}:", docs, model)) from None
