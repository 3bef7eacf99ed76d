"""Compare the touches of ``touches.py`` with the installed DeepSpeed, without a process group
(tests/test_ds_compat.py runs ``check_touch`` on every touch, ``check_override`` on every override).

Each check reads classes, signatures and source text only (``inspect``); a problem is a message
that starts with the touch's name and says what changed.
"""

from __future__ import annotations

import importlib
import inspect

from .touches import Touch


def _resolve(owner: str):
    """``"package.module:Class"`` -> the class; ``"package.module"`` -> the module."""
    module_name, _, class_name = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _has_member(owner, member: str) -> bool:
    fields = {**getattr(owner, "model_fields", {}), **getattr(owner, "__dataclass_fields__", {})}
    return hasattr(owner, member) or member in fields  # pydantic / dataclass fields without a default


def _source_problems(name: str, owner, where: str, snippets) -> list[str]:
    """``snippets`` must appear (whitespace aside) in the source of ``owner.where``."""
    method = getattr(owner, where, None)
    if method is None:
        return [f"{name}: {_label(owner)}.{where} is gone (we rely on what it does)"]
    try:
        source = _squeezed(inspect.getsource(_unwrapped(method)))
    except (OSError, TypeError):
        return [f"{name}: the source of {_label(owner)}.{where} cannot be read to check it"]
    return [f"{name}: {_label(owner)}.{where} no longer contains `{snippet}`" for snippet in snippets
            if _squeezed(snippet) not in source]


def _label(owner) -> str:
    return getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))


def _unwrapped(function):
    """The function under DeepSpeed's decorators: ``timed_op`` and ``instrument_w_nvtx`` wrap it as
    ``(*args, **kwargs)`` without ``functools.wraps``, keeping it only in their closure."""
    function = inspect.unwrap(function)
    inner = [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()
             if inspect.isfunction(cell.cell_contents)]
    if len(inner) == 1 and str(inspect.signature(function)) == "(*args, **kwargs)":
        return _unwrapped(inner[0])
    return function


def _signature_problems(name: str, owner, member: str, params: tuple[str, ...]) -> list[str]:
    """The member's parameters must start with ``params`` (names and order)."""
    try:
        parameters = inspect.signature(_unwrapped(getattr(owner, member))).parameters
    except (TypeError, ValueError):
        return [f"{name}: {_label(owner)}.{member} has no readable signature"]
    found = tuple(parameters)
    required = [n for n in found[len(params):] if parameters[n].default is inspect.Parameter.empty
                and parameters[n].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if found[:len(params)] != params or required:
        return [f"{name}: {_label(owner)}.{member} takes ({', '.join(found)}), we call it as "
                f"({', '.join(params)}, ...)"]
    return []


def check_touch(touch: Touch, owner=None) -> list[str]:
    """What no longer holds of ``touch`` in the installed DeepSpeed (``owner`` replaces the class,
    for tests). Each message starts with the touch's name."""
    try:
        owner = _resolve(touch.owner) if owner is None else owner
    except (ImportError, AttributeError) as err:
        return [f"{touch.name}: {touch.owner} cannot be imported ({err})"]
    problems = []
    if not touch.instance_attr and not _has_member(owner, touch.member):
        problems.append(f"{touch.name}: {_label(owner)} has no member {touch.member!r}")
    elif touch.params is not None:
        problems += _signature_problems(touch.name, owner, touch.member, touch.params)
    for where, snippets in touch.source:
        problems += _source_problems(touch.name, owner, where, snippets)
    return problems


def check_override(touch: Touch, ours, base=None) -> list[str]:
    """An override of ``touch.member`` in our class ``ours``: the base still has it with the
    parameters we take (``touch.params``), our method takes them too, and DeepSpeed still calls it."""
    problems = check_touch(touch, base)
    if touch.member not in vars(ours):
        problems.append(f"{touch.name}: {ours.__qualname__} no longer overrides {touch.member!r}; "
                        f"remove it from ds_compat.OVERRIDES")
    elif touch.params is not None:
        problems += _signature_problems(touch.name, ours, touch.member, touch.params)
    return problems

