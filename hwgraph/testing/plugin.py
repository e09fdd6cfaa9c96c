"""pytest plugin (entry point ``pytest11``): accelerator markers, and skips that say why.

A test marked ``cuda``, ``rocm`` or ``npu`` runs only where ``hwgraph.platform.detect()`` finds that
accelerator; elsewhere it is skipped with the reason, never reported as passed. A test marked ``cpu_machine`` asserts
what hwgraph finds on a machine without an accelerator (detection, refused gates), so it runs only there.

pytest loads this plugin in every session of an environment where hwgraph is installed, other projects' included. It
only registers the markers there; the skips (and the torch import that detection needs) apply in a session that
collected hwgraph's conformance suite, or whose ini sets ``hwgraph_markers = true`` (hwgraph's own, and its backend
plugins'). Another project's own ``cuda`` marker keeps its meaning.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest

ACCELERATOR_MARKERS = {
    "cuda": "needs an NVIDIA GPU with a CUDA build of torch",
    "rocm": "needs an AMD GPU with a ROCm build of torch",
    "npu": "needs an Ascend NPU with torch_npu",
}
CPU_MACHINE = "cpu_machine"
CPU_MACHINE_NEED = "asserts what hwgraph finds on a machine without an accelerator"
OTHER_MARKERS = {
    CPU_MACHINE: CPU_MACHINE_NEED,
    "vllm": "needs vllm installed (tox -e vllm / ci/test.sh vllm)",
    "slow": "long-running test (soak, large configs)",
}


SUITE_MODULE = "hwgraph.testing.suite"


def rewrite_suite_asserts() -> None:
    """Have pytest rewrite the shipped suite's asserts, so that a failed check shows its values (``assert [1] ==
    [64, 256]``) and not a bare ``AssertionError``. pytest rewrites test modules, and a plugin's package only when
    installed from a wheel; the suite's checks live in ``hwgraph.testing.suite``, which vendors star-import. This must
    happen before the suite is imported: here, at the plugin's import (before conftests load), and again at each
    configure (a later ``pytest.main`` in the same process, as ``hwgraph validate`` runs it)."""
    if SUITE_MODULE not in sys.modules:
        pytest.register_assert_rewrite(SUITE_MODULE)


rewrite_suite_asserts()


@functools.lru_cache(maxsize=1)
def detected_kind() -> str:
    from hwgraph.platform import detect

    return detect().kind


INI_OPTION = "hwgraph_markers"


def pytest_addoption(parser):
    parser.addini(INI_OPTION, type="bool", default=False,
                  help="skip tests marked cuda/rocm/npu off that accelerator and cpu_machine off a CPU machine, with "
                       "the reason (on without it in a session that collected hwgraph.testing.suite)")


def skips_apply(config) -> bool:
    """Whether this session is hwgraph's: its ini opted in, or it collected the conformance suite."""
    return SUITE_MODULE in sys.modules or bool(config.getini(INI_OPTION))


def pytest_configure(config):
    for name, text in {**ACCELERATOR_MARKERS, **OTHER_MARKERS}.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    rewrite_suite_asserts()


def share_cpu_threads() -> None:
    """Give each pytest-xdist worker its share of the cores for torch's CPU threads, in a session that collected
    hwgraph's conformance suite (``SUITE_MODULE``): the plugin loads in every pytest session of an environment with
    hwgraph installed, and other projects' suites keep their process's torch settings.

    Every worker otherwise starts one thread per core; oversubscribed OpenMP threads spin against each other and
    made the tiny tower's CPU forward ~100x slower on a 2-core machine. ``OMP_NUM_THREADS`` set by the user wins.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ or SUITE_MODULE not in sys.modules:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(workers))))


def pytest_collection_modifyitems(config, items):
    share_cpu_threads()  # after collection: whether the suite is among the tests is known, none has run yet
    if not skips_apply(config):
        return
    for item in items:
        for marker, need in ACCELERATOR_MARKERS.items():
            if item.get_closest_marker(marker) is not None and detected_kind() != marker:
                item.add_marker(pytest.mark.skip(reason=f"{need}; this machine is {detected_kind()}"))
        if item.get_closest_marker(CPU_MACHINE) is not None and detected_kind() != "cpu":
            item.add_marker(pytest.mark.skip(reason=f"{CPU_MACHINE_NEED}; this machine is {detected_kind()}"))
