"""Checks around tox's accelerator envs (ci/accel_env.sh), run with the env's python from the checkout's root.

``deps ACCEL``: before the offline install, name every requirement it would miss (pip stops at the first one it
cannot resolve, without saying that the env installs offline by design). ``machine ACCEL``: after it, refuse a
machine where hwgraph does not find ACCEL, whose tests would all be skipped and the env pass with nothing checked.
"""

from __future__ import annotations

import sys
from importlib import metadata

VENDOR_TORCH = {"cuda": "a CUDA build of torch", "rocm": "a ROCm build of torch (and aiter, for ROCM_AITER_FA)",
                "npu": "torch with torch_npu and the CANN toolkit"}


def requirements() -> list[str] | None:
    """The build requirement, the dependencies and the test extra, from pyproject.toml (None before Python 3.11,
    which has no tomllib)."""
    try:
        import tomllib
    except ImportError:
        return None
    with open("pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    return [*data["build-system"]["requires"], *data["project"]["dependencies"],
            *data["project"]["optional-dependencies"]["test"]]


def unmet(requirements: list[str]) -> list[str]:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # listed below as missing itself; the others are then checked for presence only
        Requirement = None
    out = []
    for line in requirements:
        req = Requirement(line) if Requirement else None
        name = req.name if req else line.split(">")[0].split("=")[0].strip()
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{line} (not installed)")
            continue
        if req and not req.specifier.contains(have, prereleases=True):
            out.append(f"{line} (found {have})")
    return out


def check_deps(accel: str) -> int:
    wanted = requirements()
    if wanted is None:
        print(f"tox -e {accel}: Python {sys.version.split()[0]} has no tomllib; requirements not checked")
        return 0
    missing = unmet(wanted)
    if missing:
        print(f"tox -e {accel}: the env installs offline, with {VENDOR_TORCH[accel]} and hwgraph's other requirements "
              f"from the system site-packages or the venv of the python3 on PATH ($PYTHON if set), but these are "
              f"not there: {', '.join(missing)}. Install them there, or run tox where they are "
              f"(PYTHON=/path/to/venv/bin/python tox -e {accel})", file=sys.stderr)
        return 2
    return 0


def check_machine(accel: str) -> int:
    import torch

    from hwgraph.platform import detect

    found = detect()
    if found.kind != accel:
        notes = "".join(f"; {note}" for note in found.notes)
        machine = f"{'an' if accel == 'npu' else 'a'} {accel} machine"
        print(f"tox -e {accel}: hwgraph finds a {found.kind} machine here (torch {torch.__version__} from "
              f"{torch.__file__}{notes}), so every {accel} test would be skipped: run this env on {machine} with "
              f"{VENDOR_TORCH[accel]}, or tox -e cpu here", file=sys.stderr)
        return 2
    print(f"tox -e {accel}: {found.device_count} x {found.device_name} ({found.arch}), torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    checks = {"deps": check_deps, "machine": check_machine}
    if len(sys.argv) != 3 or sys.argv[1] not in checks or sys.argv[2] not in VENDOR_TORCH:
        sys.exit(f"ci/accel_check.py: expected deps|machine cuda|rocm|npu, got: {' '.join(sys.argv[1:])}")
    sys.exit(checks[sys.argv[1]](sys.argv[2]))
