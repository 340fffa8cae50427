"""Typed configuration machinery: YAML recipes + dotted overrides -> validated kw-only dataclasses.

Each config dataclass lives next to the code it configures and documents every field with an
attribute docstring (the string literal right under the field). This module only knows how to
build such dataclasses from plain data, reject bad input with the full key path, read the field
docstrings back (for ``--help`` and the generated reference) and write the resolved config.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import inspect
import os
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megatron_gtpo.utils.atomic import write_text_atomic


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A recipe, override or value was rejected; the message names the key path and the fix.

    ``located``: the message already names full key paths, so ``build`` must not prefix the
    dataclass's own path to it (a ``__post_init__`` check of a pass-through block does that)."""

    def __init__(self, message: str, *, located: bool = False):
        super().__init__(message)
        self.located = located


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Range check for ``__post_init__``: raises ConfigError(field, value, allowed) when not ok.

    The loader prefixes ``field`` with the dataclass's own path (``algo.`` ...)."""
    if not ok:
        raise ConfigError(f"{field}={value!r} is not allowed: expected {allowed}")


def did_you_mean(word: Any, choices: Any, *, show=str) -> str:
    """`` (did you mean X?)`` naming the choices closest to ``word`` (up to 3), or ``''`` when none is
    close. The one place every "unknown key / value" message (config keys, Literal values, vLLM and
    Megatron pass-through keys) gets its suggestion; ``show`` formats a choice (``repr`` for values)."""
    names = {str(c): c for c in choices}
    close = difflib.get_close_matches(str(word), list(names), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(show(names[c]) for c in close)}?)" if close else ""


def require_choice(value: Any, choices: Any, field: str, *, nullable: bool = False) -> None:
    """``require`` for a value that must be one of ``choices``; the message suggests the closest."""
    if value in choices or (nullable and value is None):
        return
    allowed = f"{'null or ' if nullable else ''}one of {', '.join(map(repr, choices))}"
    raise ConfigError(f"{field}={value!r} is not allowed{did_you_mean(value, choices, show=repr)}: expected {allowed}")


# ----------------------------------------------------------------------------- building

def build(cls: type, data: Any, path: str = "") -> Any:
    """Builds dataclass ``cls`` from a mapping, checking keys and types recursively."""
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(unknown_keys_message(unknown, fields, path, f"`{' '.join(['megatron-gtpo config', path]).strip()}`"))
    kwargs = {name: _coerce(hints[name], _with_dict_defaults(fields[name], value), _join(path, name))
              for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if err.located or not path:
            raise
        raise ConfigError(f"{path}.{err}") from None
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{where}: {err}") from None


def unknown_keys_message(unknown: list, allowed: Any, path: str, listing: str) -> str:
    """"unknown key a.b (did you mean a.c?)": each key with its suggestion; the full list of allowed
    keys only when some key has none (``listing`` names where to read them otherwise)."""
    hints = [_join(path, k) + did_you_mean(k, allowed, show=lambda c: _join(path, c)) for k in unknown]
    text = f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}"
    if all("did you mean" in h for h in hints):
        return f"{text}; every key: {listing}"
    return f"{text}; allowed keys under {path or '<root>'}: {', '.join(sorted(map(str, allowed)))}"


def _with_dict_defaults(f: dataclasses.Field, value: Any) -> Any:
    """A mapping given for a dict field with a default mapping (native pass-through blocks such as
    ``optim.optimizer``) is merged over the defaults: setting one key keeps the others."""
    if isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
        if isinstance(default, dict):
            return {**default, **value}
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _describe(hint: Any) -> str:
    """A union member in an error message: ``float``, ``one of 'auto'``."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except ConfigError as err:
                errors.append(str(err))
        kinds = " or ".join(_describe(a) for a in args if a is not type(None))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}={value!r} is not allowed: expected {kinds}")
    if origin is Literal:
        if isinstance(value, bool) and ("off" if value is False else "on") in args:
            value = "off" if value is False else "on"  # YAML 1.1 reads a bare off / on as a boolean
        require_choice(value, args, path)
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        out = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return {k: _coerce(args[1] if args else Any, v, f"{path}.{k}") for k, v in value.items()}
    return _coerce_scalar(hint, value, path)


def _coerce_scalar(hint: type, value: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif isinstance(value, hint):
        return value
    raise ConfigError(f"{path}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__} {value!r}")


# ----------------------------------------------------------------------------- recipes

def load_recipe(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict:
    """Reads a YAML recipe. A top-level ``base: other.yaml`` key (relative to the file) is loaded
    first and deep-merged under this file's values. A ``base:`` chain that comes back to a file
    already in it (a file naming itself, a -> b -> a) is a ConfigError naming the chain."""
    path = Path(path)
    if not path.is_file():
        where = f" (base: of {_chain[-1]})" if _chain else ""
        raise ConfigError(f"recipe file {path}{where} does not exist; pass a YAML file such as configs/gtpo.yaml")
    resolved = path.resolve()
    if resolved in _chain:
        loop = " -> ".join(str(p) for p in (*_chain[_chain.index(resolved):], resolved))
        raise ConfigError(f"recipe base: chain loops back on itself: {loop}; remove or change the `base:` key "
                          f"of {_chain[-1]}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe file {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe file {path} must hold a mapping at the top level")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"recipe file {path}: base={base!r} must be a file name such as base.yaml")
        data = deep_merge(load_recipe(path.parent / base, (*_chain, resolved)), data)
    return data


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies ``a.b.c=value`` overrides; values are parsed as YAML (``3``, ``1e-6``, ``[1,2]``, ``null``)."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. algo.entropy_threshold=0.7)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[parts[-1]] = value
    return data


def to_dict(cfg: Any) -> Any:
    """Plain-data view of a config (for YAML dumps and tracking params)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def write_yaml_atomic(data: Any, path: str | os.PathLike) -> Path:
    """Writes YAML to ``path`` through a temp file and an atomic rename."""
    return write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


# ----------------------------------------------------------------------------- docs

def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: ``{field: doc}`` read from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Rows ``(key path, type, default, doc)`` for every leaf field, recursing into sub-configs."""
    rows = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "<required>"
        rows.append((prefix + f.name, type_name(hint), default, docs.get(f.name, "")))
    return rows


def type_name(hint: Any) -> str:
    """A field's type as ``megatron-gtpo config`` shows it: a Literal as its allowed values
    (``one of 'gtpo', 'grpo'``), ``| None`` for an optional field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if hint is type(None):
        return "None"
    if origin in (list, tuple, dict):
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
