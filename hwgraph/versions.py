"""The software a report was made with: platform facts and installed versions (read, never imported)."""

from __future__ import annotations

import platform as host
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("hwgraph", "torch", "transformers", "numpy", "triton", "flash-attn", "aiter", "torch-npu", "matplotlib",
            "pytest", "hwgraph-backend-cuda", "hwgraph-backend-rocm", "hwgraph-backend-npu")


# Distributions published under another name as well: aiter's setup.py names it "amd-aiter" in newer releases
ALSO_NAMED = {"aiter": ("amd-aiter",)}


def installed(name: str) -> str | None:
    """The installed version of distribution ``name`` (or of one of its other names), else None."""
    for candidate in (name, *ALSO_NAMED.get(name, ())):
        try:
            return version(candidate)
        except PackageNotFoundError:
            continue
    return None


def report_packages() -> tuple[str, ...]:
    """``PACKAGES``, then the distribution of every other graph backend plugin installed here (a vendor's own, whose
    report must say which version it validated)."""
    from hwgraph.registry import backend_specs

    plugins = [spec.distribution for spec in backend_specs() if spec.distribution]
    return tuple(dict.fromkeys([*PACKAGES, *plugins]))


def environment() -> dict:
    """``{"platform": detect().as_dict(), "python": ..., "host": ..., "packages": {name: version or None}}``."""
    from hwgraph.platform import detect

    return {"platform": detect().as_dict(), "python": host.python_version(),
            "host": f"{host.system()} {host.release()} {host.machine()}",
            "packages": {name: installed(name) for name in report_packages()}}
