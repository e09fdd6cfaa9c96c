"""Capability gates: whether a backend or kernel can run here, and if not, why.

A gate never raises for a missing dependency: an ImportError becomes a reason. Comparisons use typed values
(``packaging.version.Version`` and integer tuples), never strings.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Capability:
    """``ok`` when ``reasons`` is empty; otherwise each reason says what is missing, in words a user can act on."""

    reasons: tuple[str, ...] = ()

    def __post_init__(self):
        # Capability("needs X") listed each letter as a reason ("n; e; e; d; s; ..."), and a list broke ``&``.
        if not isinstance(self.reasons, (tuple, list)) or not all(isinstance(r, str) for r in self.reasons):
            raise TypeError(f"a Capability's reasons are strings in a tuple, got {self.reasons!r} "
                            f"(Capability.unavailable(reason, ...) makes one)")
        object.__setattr__(self, "reasons", tuple(self.reasons))

    @property
    def ok(self) -> bool:
        return not self.reasons

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def available(cls) -> Capability:
        return cls(())

    @classmethod
    def unavailable(cls, *reasons: str) -> Capability:
        if not reasons:
            raise ValueError("an unavailable Capability needs at least one reason")
        return cls(tuple(reasons))

    def __and__(self, other: Capability) -> Capability:
        return Capability(self.reasons + tuple(r for r in other.reasons if r not in self.reasons))

    def describe(self) -> str:
        return "available" if self.ok else "; ".join(self.reasons)


def parse_version(text: str | None) -> Version | None:
    """``Version`` of a version string such as ``2.13.0+cpu`` or ``13.0``; None when absent or unparsable."""
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        match = re.match(r"\d+(\.\d+)*", str(text))
        return Version(match.group(0)) if match else None


def sm_tuple(arch: str | None) -> tuple[int, int] | None:
    """``'sm_90'`` -> ``(9, 0)``, ``'sm_100'`` -> ``(10, 0)``; None when not an sm_ architecture."""
    match = re.fullmatch(r"sm_(\d+)(\d)a?", arch or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


#: The oldest NVIDIA compute capability Triton compiles for (torch.utils._triton.has_triton: "Triton only supports
#: devices of CUDA Capability >= 7.0"): TRITON_ATTN's gate and the tower's fused kernels hold to it.
TRITON_MIN_COMPUTE_CAPABILITY = (7, 0)


def gfx_name(arch: str | None) -> str | None:
    """``'gfx942:sramecc+:xnack-'`` -> ``'gfx942'`` (the part before the first ':')."""
    if not arch:
        return None
    base = arch.split(":", 1)[0].strip()
    return base if base.startswith("gfx") else None


def require_module(module: str, what: str) -> Capability:
    """Gate on an importable module; the ImportError text becomes the reason."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a vendor SDK failing while it initialises
        return Capability.unavailable(f"{what} needs the {module} package ({type(exc).__name__}: {exc})")
    return Capability.available()
