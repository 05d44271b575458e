"""The members of vLLM's classes this engine does not serve, refused at use naming the feature.

vllm_members.json lists every public attribute and method of vLLM 0.32's ``AsyncLLM``,
``LLM``, ``LLMEngine``, ``EngineArgs``, ``ModelConfig`` and ``SamplingParams``
(tools/vllm_members.py). Each class here either implements a member or names it in a table
given to ``refuses``. A named member is made only when a script asks for it (``Refusing``'s
``__getattr__``, on the class and on its instances: the request path never reads the JSON): a
method in vLLM's kind (async where vLLM's is, static or class where vLLM's is) that raises
``UnsupportedFeatureError`` when called, or an attribute that raises
``UnsupportedAttributeError`` (also an ``AttributeError``, so ``getattr(x, name, None)``
answers None) when read. tests/test_vllm_members.py checks no member is left out and every
table names only vLLM members the class does not implement.
"""
from __future__ import annotations

import functools
import json
import types
from pathlib import Path

from vllm_api.errors import UnsupportedAttributeError, UnsupportedFeatureError

MEMBERS_FILE = Path(__file__).with_name("vllm_members.json")


@functools.cache
def vllm_members() -> dict[str, dict]:
    """Our class name -> {"init": vLLM's parameters, "members": {name: {"kind", ...}}}."""
    return json.loads(MEMBERS_FILE.read_text())["classes"]


def refused_method(name: str, feature: str, reason: str, is_async: bool):
    def refused(*_args, **_kwargs):
        raise UnsupportedFeatureError(feature, reason)

    async def refused_async(*_args, **_kwargs):
        raise UnsupportedFeatureError(feature, reason)

    method = refused_async if is_async else refused
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Refused: {feature} ({reason})."
    method.refusal = (feature, reason)
    return method


def refused_attribute(feature: str, reason: str) -> property:
    def read(_self):
        raise UnsupportedAttributeError(feature, reason)
    prop = property(read, doc=f"Refused: {feature} ({reason}).")
    read.refusal = (feature, reason)
    return prop


METHOD_KINDS = ("method", "async method", "classmethod", "staticmethod")


class RefusingType(type):
    """The metaclass of ``Refusing``: a refused member read on the class itself (a
    ``LLMEngine.from_vllm_config(...)``, ``LLM.renderer``) is made then."""

    def __getattr__(cls, name: str):
        refused = _refused(cls, name)
        if refused is None:
            raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")
        kind, member = refused
        return member if kind in METHOD_KINDS else refused_attribute(*cls.REFUSED_MEMBERS[name])

    def __dir__(cls):
        return sorted(set(super().__dir__()) | set(cls.REFUSED_MEMBERS))


class Refusing(metaclass=RefusingType):
    """The base of a vLLM class this engine serves in part (its ``refuses`` table)."""

    VLLM_CLASS: str | None = None
    REFUSED_MEMBERS: dict[str, tuple[str, str]] = {}

    def __getattr__(self, name: str):
        refused = _refused(type(self), name)
        if refused is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        kind, member = refused
        if kind in ("method", "async method"):
            return types.MethodType(member, self)
        if kind in METHOD_KINDS:
            return member
        raise UnsupportedAttributeError(*type(self).REFUSED_MEMBERS[name])

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(type(self).REFUSED_MEMBERS))


def refuses(vllm_class: str, table: dict[str, tuple[str, str]]):
    """Class decorator (on a ``Refusing`` subclass): the members of vLLM's ``vllm_class`` named
    in ``table`` (``name -> (feature, reason)``) are refusals, made when first asked for."""
    def install(cls):
        if not issubclass(cls, Refusing):
            raise TypeError(f"{cls.__name__} must derive from Refusing to refuse members")
        cls.VLLM_CLASS = vllm_class
        cls.REFUSED_MEMBERS = {**cls.REFUSED_MEMBERS, **table}
        return cls
    return install


def _refused(cls, name: str):
    """(vLLM's kind, the refused method or None) when ``name`` is a refusal of ``cls``."""
    if name.startswith("__") or name not in cls.REFUSED_MEMBERS:
        return None
    return _made(cls.VLLM_CLASS, name, cls.REFUSED_MEMBERS[name])


@functools.cache
def _made(vllm_class: str, name: str, refusal: tuple[str, str]):
    kind = vllm_members()[vllm_class]["members"][name]["kind"]
    if kind not in METHOD_KINDS:
        return kind, None
    return kind, refused_method(name, *refusal, is_async=kind == "async method")


def refusal_of(cls, name: str) -> tuple[str, str] | None:
    """(feature, reason) when ``cls.name`` is a refusal, else None."""
    member = None
    for klass in cls.__mro__:
        if name in vars(klass):
            member = vars(klass)[name]
            break
    else:
        return getattr(cls, "REFUSED_MEMBERS", {}).get(name)
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, staticmethod):
        member = member.__func__
    return getattr(member, "refusal", None)
