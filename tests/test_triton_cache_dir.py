"""Compiled mode's Triton cache folder: pinned only where Triton can use it (``compile_mode.pin_triton_cache_dir``)."""

from __future__ import annotations

import logging
import os

import torch

from hwgraph.compile_mode import pin_triton_cache_dir


def environment_without_triton_folder(monkeypatch, inductor_folder):
    """A copy of the environment (what the function sets does not outlive the test) naming ``inductor_folder`` as
    inductor's cache and no Triton folder."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_folder)
    monkeypatch.setattr(os, "environ", env)


def test_a_triton_folder_that_cannot_be_made_is_not_pinned(tmp_path, monkeypatch, caplog):
    """Inductor's folder exists but its ``triton`` entry is a file: the folder was pinned anyway, and every Triton
    kernel of the process (hwgraph's own, in plain captures and eager calls) then failed to compile (Triton makes
    its cache folder first), not only the compiled captures, which fall back."""
    (tmp_path / "triton").write_text("a file where a folder should be")
    environment_without_triton_folder(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="hwgraph.compile_mode"):
        assert pin_triton_cache_dir(torch.device("cuda", 0)) is None
    assert "TRITON_CACHE_DIR" not in os.environ
    assert "Triton's cache folder for compiled mode is not set: " in caplog.text
    assert str(tmp_path / "triton") in caplog.text  # names the folder


def test_a_triton_folder_that_cannot_be_written_is_not_pinned(tmp_path, monkeypatch, caplog):
    """A read-only inductor cache (a mounted, pre-filled one): pinning it made Triton's own kernels fail to write
    their cache. (``os.access`` stands in for the mount: as root, a chmod does not stop writes.)"""
    environment_without_triton_folder(monkeypatch, tmp_path)
    folder = str(tmp_path / "triton" / "0")
    access = os.access

    def read_only(path, mode, **kw):
        return str(path) != folder and access(path, mode, **kw)

    monkeypatch.setattr(os, "access", read_only)
    with caplog.at_level(logging.WARNING, logger="hwgraph.compile_mode"):
        assert pin_triton_cache_dir(torch.device("cuda", 0)) is None
    assert "TRITON_CACHE_DIR" not in os.environ
    assert f"{folder} is not writable" in caplog.text


def test_a_writable_triton_folder_is_made_and_pinned(tmp_path, monkeypatch):
    environment_without_triton_folder(monkeypatch, tmp_path)
    folder = str(tmp_path / "triton" / "1")
    assert pin_triton_cache_dir(torch.device("cuda", 1)) == folder == os.environ["TRITON_CACHE_DIR"]
    assert os.path.isdir(folder)
