"""The fast layer's kernel build is keyed by its sources' content, its flags and its source
directory (fast/kernels.py ``_name()``): two checkouts with identical sources keep their own
builds, one checkout keeps one name, and an edited source gets a new one. Nothing is compiled:
``CSRC`` / ``SOURCES`` point at temporary copies."""
from __future__ import annotations

import shutil

import pytest

from fast import kernels


def copy_sources(directory):
    directory.mkdir()
    for source in kernels.SOURCES:
        shutil.copy(source, directory / source.name)
    return directory


@pytest.fixture
def use_sources(monkeypatch):
    def use(directory):
        monkeypatch.setattr(kernels, "CSRC", directory)
        monkeypatch.setattr(kernels, "SOURCES", tuple(directory / p.name for p in kernels.SOURCES))
        return kernels._name()
    return use


def test_identical_sources_in_two_directories_get_two_build_names(tmp_path, use_sources):
    first, second = copy_sources(tmp_path / "a"), copy_sources(tmp_path / "b")
    for source in kernels.SOURCES:
        assert (first / source.name).read_bytes() == (second / source.name).read_bytes()
    name_a, name_b = use_sources(first), use_sources(second)
    assert name_a != name_b
    assert name_a.startswith("step14_kernels_") and name_b.startswith("step14_kernels_")


def test_one_directory_keeps_one_name_until_a_source_changes(tmp_path, use_sources):
    directory = copy_sources(tmp_path / "csrc")
    name = use_sources(directory)
    assert use_sources(directory) == name  # the same directory, the same sources
    edited = directory / kernels.SOURCES[-1].name
    edited.write_bytes(edited.read_bytes() + b"\n// edited\n")
    assert use_sources(directory) != name


def test_the_name_follows_the_flags(tmp_path, use_sources, monkeypatch):
    directory = copy_sources(tmp_path / "csrc")
    name = use_sources(directory)
    monkeypatch.setattr(kernels, "FLAGS", (*kernels.FLAGS, "-DSOMETHING_ELSE"))
    assert use_sources(directory) != name


def test_the_sanitized_build_has_its_own_flags_and_name(tmp_path, use_sources, monkeypatch):
    """STEP14_SANITIZE=address (tools/sanitize.py) builds a checked copy beside the regular one."""
    directory = copy_sources(tmp_path / "csrc")
    monkeypatch.delenv("STEP14_SANITIZE", raising=False)
    regular = use_sources(directory)
    assert kernels.build_flags() == (kernels.FLAGS, ["-fopenmp"])
    monkeypatch.setenv("STEP14_SANITIZE", "address")
    cflags, ldflags = kernels.build_flags()
    assert "-fsanitize=address,undefined" in cflags and "-D_GLIBCXX_ASSERTIONS" in cflags
    assert "-fsanitize=address,undefined" in ldflags
    assert use_sources(directory) != regular


def test_the_sanitizer_run_preloads_the_runtimes_it_needs():
    from tools.sanitize import TESTS, sanitized_env
    env = sanitized_env()
    preload = env["LD_PRELOAD"].split()
    assert [p.rsplit("/", 1)[-1].split(".so")[0] for p in preload] == ["libasan", "libstdc++"]
    assert env["STEP14_SANITIZE"] == "address" and "halt_on_error=1" in env["ASAN_OPTIONS"]
    assert all((kernels.CSRC.parent.parent / t).is_file() for t in TESTS)
