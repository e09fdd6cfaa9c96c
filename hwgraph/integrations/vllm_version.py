"""The vLLM version gate of hwgraph's vLLM integration: imported first by ``hwgraph.integrations.vllm`` and
``hwgraph.integrations.vllm_manager``, so that either refuses an absent or unsupported vLLM with a clear message
before importing vLLM internals, whichever of them is imported first."""

from __future__ import annotations

import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

log = logging.getLogger("hwgraph.integrations.vllm")

# The protocol's method signatures and the manager's internals (which SingleReplayEncoderCudaGraphManager relies on)
# change between vLLM releases, so only the minor series the integration was written and tested against is accepted:
# its dev builds, pre-releases and local builds too (0.33.0.dev5, 0.33.0rc1, 0.33.1.dev3+g...), none of 0.32 or 0.34
# (PEP 440: "<0.34" excludes 0.34's pre-releases).
SUPPORTED_VLLM = SpecifierSet(">=0.33.0.dev0,<0.34")
ALLOW_UNSUPPORTED_ENV = "HWGRAPH_VLLM_ALLOW_UNSUPPORTED"
INSTALL_HINT = "pip install 'hwgraph[vllm]'"


class UnsupportedVllmError(ImportError):
    """The installed vLLM is outside ``SUPPORTED_VLLM``."""


def check_vllm_version(found: str | None) -> Version:
    """The installed vLLM version, or ``UnsupportedVllmError`` saying what is supported and how to get it.

    Setting ``$HWGRAPH_VLLM_ALLOW_UNSUPPORTED=1`` turns the refusal into a warning (for trying a newer vLLM).
    """
    try:
        version = Version(found) if found else None
    except InvalidVersion:
        version = None
    # Pre-releases and dev builds of the supported series (0.33.0rc1, 0.33.1.dev3+g...) are accepted: same protocol.
    if version is not None and SUPPORTED_VLLM.contains(version, prereleases=True):
        return version
    message = (f"hwgraph.integrations.vllm supports vllm {SUPPORTED_VLLM} (the encoder CUDA graph protocol and "
               f"EncoderCudaGraphManager change between releases); found vllm {found or 'of unknown version'}. "
               f"Install a supported one with {INSTALL_HINT} (vllm==0.33.0), or set {ALLOW_UNSUPPORTED_ENV}=1 "
               f"to try this one anyway.")
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        log.warning(message)
        return version or Version("0")
    raise UnsupportedVllmError(message)


try:
    import vllm as _vllm
except ImportError as exc:
    if exc.name == "vllm":  # only vllm itself missing; a bare ImportError raised inside vLLM has name None
        raise ImportError(f"hwgraph.integrations.vllm needs vLLM, which is not installed: {INSTALL_HINT} "
                          f"(vllm==0.33.0)") from exc
    raise ImportError(f"vLLM is installed but failed to import ({exc}); hwgraph.integrations.vllm needs a "
                      f"working vllm==0.33.0: {INSTALL_HINT}") from exc

VLLM_VERSION = check_vllm_version(getattr(_vllm, "__version__", None))
