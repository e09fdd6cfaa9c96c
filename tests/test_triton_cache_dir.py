"""Compiled mode's Triton cache folder: pinned only where Triton can use it (``compile_mode.pin_triton_cache_dir``)."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from hwgraph.compile_mode import pin_triton_cache_dir


def environment_without_triton_folder(monkeypatch, inductor_folder):
    """A copy of the environment (what the function sets does not outlive the test) naming ``inductor_folder`` as
    inductor's cache and no Triton folder; Triton's home (its default cache's parent) is in ``inductor_folder`` too.
    Returns the folder Triton caches in by default there."""
    monkeypatch.setenv("TRITON_HOME", str(inductor_folder / "home"))  # in the process's own environment: Triton reads
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}  # that one, not os.environ
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_folder)
    monkeypatch.setattr(os, "environ", env)
    return str(inductor_folder / "home" / ".triton" / "cache")


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton's default cache folder is Triton's to name; triton is not installed")


@needs_triton
def test_a_triton_folder_that_cannot_be_made_is_not_pinned_and_tritons_default_is(tmp_path, monkeypatch, caplog):
    """Inductor's folder exists but its ``triton`` entry is a file: the folder was pinned anyway, and every Triton
    kernel of the process (hwgraph's own, in plain captures and eager calls) then failed to compile (Triton makes
    its cache folder first), not only the compiled captures, which fall back. Left unset instead, inductor itself
    would switch the process to it as it loaded its first kernel: Triton's default folder is pinned."""
    (tmp_path / "triton").write_text("a file where a folder should be")
    default = environment_without_triton_folder(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="hwgraph.compile_mode"):
        assert pin_triton_cache_dir(torch.device("cuda", 0)) == default == os.environ["TRITON_CACHE_DIR"]
    assert os.path.isdir(default)
    assert f"Triton's cache folder for compiled mode is Triton's default, {default}: inductor's cannot be used: " \
        in caplog.text
    assert str(tmp_path / "triton") in caplog.text  # names inductor's folder


@needs_triton
def test_a_triton_folder_that_cannot_be_written_is_not_pinned_and_tritons_default_is(tmp_path, monkeypatch, caplog):
    """A read-only inductor cache (a mounted, pre-filled one): pinning it made Triton's own kernels fail to write
    their cache. (``os.access`` stands in for the mount: as root, a chmod does not stop writes.)"""
    default = environment_without_triton_folder(monkeypatch, tmp_path)
    folder = str(tmp_path / "triton" / "0")
    access = os.access

    def read_only(path, mode, **kw):
        return str(path) != folder and access(path, mode, **kw)

    monkeypatch.setattr(os, "access", read_only)
    with caplog.at_level(logging.WARNING, logger="hwgraph.compile_mode"):
        assert pin_triton_cache_dir(torch.device("cuda", 0)) == default == os.environ["TRITON_CACHE_DIR"]
    assert f"{folder} is not writable" in caplog.text


@needs_triton
def test_no_folder_is_pinned_when_neither_inductors_nor_tritons_default_can_be_used(tmp_path, monkeypatch, caplog):
    default = environment_without_triton_folder(monkeypatch, tmp_path)
    access = os.access

    def read_only(path, mode, **kw):
        return str(path) not in (str(tmp_path / "triton" / "0"), default) and access(path, mode, **kw)

    monkeypatch.setattr(os, "access", read_only)
    with caplog.at_level(logging.WARNING, logger="hwgraph.compile_mode"):
        assert pin_triton_cache_dir(torch.device("cuda", 0)) is None
    assert "TRITON_CACHE_DIR" not in os.environ
    assert "Triton's cache folder for compiled mode is not set: " in caplog.text
    assert f"nor can Triton's default folder be used: {default} is not writable" in caplog.text


def test_a_writable_triton_folder_is_made_and_pinned(tmp_path, monkeypatch):
    environment_without_triton_folder(monkeypatch, tmp_path)
    folder = str(tmp_path / "triton" / "1")
    assert pin_triton_cache_dir(torch.device("cuda", 1)) == folder == os.environ["TRITON_CACHE_DIR"]
    assert os.path.isdir(folder)
