"""The versions a report names (``hwgraph.versions``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError

from hwgraph import versions


def test_aiter_is_found_under_the_name_its_newer_releases_publish(monkeypatch):
    """aiter's newer releases install as the distribution "amd-aiter": a report read only "aiter" and said it was
    absent on a ROCm machine that had it."""
    published = {"amd-aiter": "0.1.5"}

    def version(name):
        if name not in published:
            raise PackageNotFoundError(name)
        return published[name]

    monkeypatch.setattr(versions, "version", version)
    assert versions.installed("aiter") == "0.1.5"
    published["aiter"] = "0.1.0"  # an older release, under the old name, is read first
    assert versions.installed("aiter") == "0.1.0"
    assert versions.installed("flash-attn") is None
