"""vLLM 0.32's class surface against this engine's: each public member of ``AsyncLLM``,
``LLM``, ``LLMEngine``, ``EngineArgs``, ``ModelConfig`` and ``SamplingParams``
(vllm_members.json), and what it is here -- implemented, neutral (it reads as vLLM's
default: the feature off), refused at use naming the feature, or missing. A member counts as
refused at use when a refusal table names it (refusals.py) or when its implementation does
nothing but refuse: its body (past the docstring) is one ``refuse(...)`` call or one
``raise UnsupportedFeatureError(...)`` (``refuse_only``, read from the source). A method that
serves some calls and refuses others (``sleep(level=1)``, ``start_profile`` with a window) is
implemented.

``markdown()`` is the figures table and the refusals docs/vllm_api.md carries
(``python -m tools.vllm_surface_doc`` writes it); tests/test_vllm_members.py checks that
none is missing on live objects, that each refusal names its feature, and the signatures.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from vllm_api import engine_args
from vllm_api.engine_arg_refusals import FEATURE_OF
from vllm_api.errors import UnsupportedFeatureError, refuse
from vllm_api.model_config import FEATURE_OFF
from vllm_api.refusals import refusal_of, vllm_members

STATUSES = ("implemented", "neutral", "refused at use")


@functools.cache
def classes() -> dict[str, type]:
    from vllm_api.async_llm import AsyncLLM
    from vllm_api.llm import LLM
    from vllm_api.llm_engine import LLMEngine
    from vllm_api.model_config import ModelConfig
    from vllm_api.sampling_params import SamplingParams
    return {"AsyncLLM": AsyncLLM, "LLM": LLM, "LLMEngine": LLMEngine,
            "EngineArgs": engine_args.EngineArgs, "ModelConfig": ModelConfig,
            "SamplingParams": SamplingParams}


def status_of(class_name: str, name: str) -> tuple[str, str]:
    """(status, why) of vLLM's ``class_name.name`` here, from the tables (not live objects)."""
    refusal = refusal_of(classes()[class_name], name)
    if refusal is not None:
        return "refused at use", f"{refusal[0]}: {refusal[1]}"
    refusal = refuse_only(classes()[class_name], name)
    if refusal is not None:
        return "refused at use", f"{refusal[0]}: {refusal[1]}"
    if class_name == "EngineArgs":
        return engine_arg_status(name)
    if class_name == "ModelConfig" and _reads_vllm_default(name):
        return "neutral", "reads vLLM's default: the feature is off here"
    return "implemented", ""


def refuse_only(cls, name: str) -> tuple[str, str] | None:
    """(feature, reason) when ``cls.name`` is a function (method, static / class method,
    property getter) whose body does nothing but refuse, else None. The feature and reason
    are its call's arguments where they are constants or module names (as the source spells
    them otherwise)."""
    member = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if not inspect.isfunction(member) or hasattr(member, "__wrapped__"):
        return None  # a wrapper may do more than the function it wraps
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(member)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0]  # its decorators made ``member`` itself (property, staticmethod)
    if (not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            or function.name != member.__code__.co_name):
        return None
    body = function.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]  # the docstring
    if len(body) != 1:
        return None
    statement = body[0]
    if isinstance(statement, ast.Expr):
        call, target = statement.value, refuse
    elif isinstance(statement, ast.Raise) and statement.cause is None:
        call, target = statement.exc, UnsupportedFeatureError
    else:
        return None
    if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name)
            or member.__globals__.get(call.func.id) is not target or len(call.args) != 2
            or call.keywords):
        return None
    return tuple(_value(arg, member.__globals__) for arg in call.args)


def _value(node: ast.expr, names: dict) -> str:
    """A refusal argument's text: evaluated when it is made of constants and module names
    only, else as the source spells it."""
    if all(isinstance(n, (ast.Constant, ast.Name, ast.Load, ast.BinOp, ast.Add))
           for n in ast.walk(node)):
        try:
            return str(eval(compile(ast.Expression(node), "<refusal>", "eval"), dict(names)))
        except NameError:  # a parameter of the function
            pass
    return ast.unparse(node)


def engine_arg_status(name: str) -> tuple[str, str]:
    if name in FEATURE_OF:
        return "refused at use", f"{FEATURE_OF[name]} (accepted only off)"
    if name in engine_args.UNSUPPORTED:
        return "refused at use", engine_args.UNSUPPORTED[name].why
    if name in engine_args.NEUTRAL:
        return "neutral", engine_args.NEUTRAL[name].why
    return "implemented", ""


def _reads_vllm_default(name: str) -> bool:
    from vllm_api.model_config import FROM_ENGINE_CONFIG, ModelConfig
    if name in FEATURE_OFF:
        return True
    member = vllm_members()["ModelConfig"]["members"][name]
    return (member["kind"] == "field" and name not in FROM_ENGINE_CONFIG
            and name not in vars(ModelConfig))


def figures() -> dict[str, dict[str, int]]:
    """Class -> {"members": n, and a count per status}."""
    out = {}
    for class_name, listing in vllm_members().items():
        counts = {"members": len(listing["members"]), **{s: 0 for s in STATUSES}}
        for name in listing["members"]:
            counts[status_of(class_name, name)[0]] += 1
        out[class_name] = counts
    return out


def markdown() -> str:
    lines = ["| class | vLLM 0.32 members | " + " | ".join(STATUSES) + " |",
             "|---|---:|" + "---:|" * len(STATUSES)]
    for class_name, counts in figures().items():
        lines.append(f"| `{class_name}` | {counts['members']} | "
                     + " | ".join(str(counts[s]) for s in STATUSES) + " |")
    for class_name, listing in vllm_members().items():
        refused = [(n, status_of(class_name, n)[1]) for n in listing["members"]
                   if status_of(class_name, n)[0] == "refused at use"]
        lines += ["", f"#### `{class_name}`: refused at use", "", "| member | why |", "|---|---|"]
        lines += [f"| `{n}` | {why} |" for n, why in refused]
    return "\n".join(lines) + "\n"
