"""The members of vLLM's classes this engine does not serve, refused at use naming the feature.

vllm_members.json lists every public attribute and method of vLLM 0.32's ``AsyncLLM``,
``LLM``, ``LLMEngine``, ``EngineArgs``, ``ModelConfig`` and ``SamplingParams``
(tools/vllm_members.py). Each class here either implements a member or names it in a table
given to ``refuses``, which adds it to the class in vLLM's kind: a method (async where vLLM's
is) that raises ``UnsupportedFeatureError`` when called, or an attribute that raises
``UnsupportedAttributeError`` (also an ``AttributeError``, so ``getattr(x, name, None)``
answers None) when read. tests/test_vllm_members.py checks no member is left out.
"""
from __future__ import annotations

import functools
import json
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


def refuses(vllm_class: str, table: dict[str, tuple[str, str]]):
    """Class decorator: add each ``name -> (feature, reason)`` of ``table`` as a refusal of
    vLLM's kind for that member. A name the class implements, or vLLM's class lacks, is a
    mistake in the table and raises at import."""
    members = vllm_members()[vllm_class]["members"]

    def install(cls):
        for name, (feature, reason) in table.items():
            if name not in members or name in vars(cls):
                raise TypeError(f"refusal table of {cls.__name__}: {name!r} is "
                                f"{'not a vLLM member' if name not in members else 'implemented'}")
            kind = members[name]["kind"]
            if kind in ("method", "async method", "classmethod", "staticmethod"):
                member = refused_method(name, feature, reason, kind == "async method")
                setattr(cls, name, staticmethod(member) if kind != "method"
                        and kind != "async method" else member)
            else:
                setattr(cls, name, refused_attribute(feature, reason))
        cls.REFUSED_MEMBERS = {**getattr(cls, "REFUSED_MEMBERS", {}), **table}
        return cls
    return install


def refusal_of(cls, name: str) -> tuple[str, str] | None:
    """(feature, reason) when ``cls.name`` is a refusal, else None."""
    member = None
    for klass in cls.__mro__:
        if name in vars(klass):
            member = vars(klass)[name]
            break
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, staticmethod):
        member = member.__func__
    return getattr(member, "refusal", None)
