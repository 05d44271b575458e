"""vLLM's public names, derived from vLLM 0.32's modules (vllm_api/vllm_names.json), not by
hand: each is importable from ``engine`` unless listed as not provided with a reason; no
table names a name vLLM does not have; docs/vllm_api.md carries the current table."""
from __future__ import annotations

import engine
from tools.vllm_surface_doc import DOC, rewrite
from vllm_api import surface

ALL_NAMES = {name for names in surface.vllm_names().values() for name in names}


def test_every_vllm_name_not_declared_missing_imports_from_engine():
    missing = sorted(name for name in ALL_NAMES
                     if surface.status_of(name)[0] != "not provided" and not hasattr(engine, name))
    assert missing == []


def test_the_tables_name_only_vllms_names_and_say_why():
    for table in (surface.NOT_PROVIDED, surface.REFUSED, surface.NEUTRAL):
        assert set(table) <= ALL_NAMES, sorted(set(table) - ALL_NAMES)
        assert all(why for why in table.values())


def test_names_scripts_met_missing_are_there():
    from engine import AsyncLLM, KVEventsConfig, LogprobsMode  # the two import failures
    assert "processed_logprobs" in LogprobsMode.__args__ and AsyncLLM and KVEventsConfig


def test_the_docs_carry_the_current_table():
    text = DOC.read_text()
    assert rewrite(text) == text, "run: python -m tools.vllm_surface_doc"
