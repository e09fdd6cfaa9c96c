"""The ci/ scripts that build wheels ship the checkout's modules only, and ci/h200.sh's exit status counts every step.
The scripts run in a copy of the checkout, with stand-in commands for everything that would install or need a GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="the ci/ scripts are bash scripts; no bash on this machine")
SKIP = {".git", ".venv", ".venv-vllm", "out", "build", "__pycache__"}


def copy_tree(dest: Path) -> None:
    """The checkout's sources (no venvs, no build output) copied into ``dest``."""
    shutil.copytree(ROOT, dest, ignore=lambda _, names: [n for n in names if n in SKIP or n.endswith(".egg-info")])


def stand_in(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n" + body)
    (folder / name).chmod(0o755)


def python_that_only_builds(bin_dir: Path) -> None:
    """`python` runs pip's wheel builds for real; installs, and the venv pkg_check.sh makes, do nothing."""
    stand_in(bin_dir, "python", f"""case " $* " in
  *" -m venv "*) for last; do :; done; mkdir -p "$last/bin"
    printf '#!/bin/sh\\ncat >/dev/null 2>&1; exit 0\\n' > "$last/bin/python"; cp "$last/bin/python" "$last/bin/hwgraph"
    chmod +x "$last/bin/python" "$last/bin/hwgraph"; exit 0;;
  *" install "*) exit 0;;
esac
exec {sys.executable} "$@"
""")


def plant_stale_module(src: Path, dist: str, package: str) -> None:
    """What an earlier build left in build/lib: a module the checkout has since removed."""
    stale = src / dist / "build" / "lib" / package / "removed_since.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("GONE = True\n")


def wheel_names(folder: Path, dist_name: str) -> list[str]:
    (wheel,) = folder.glob(f"{dist_name}-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_install_extra_builds_plugin_wheels_without_what_an_earlier_build_left(tmp_path):
    """setuptools packs build/lib as it finds it: a plugin module removed (or renamed) since tox's last run still
    shipped in the wheel the env installs, so the tests imported code the checkout no longer has."""
    src = tmp_path / "src"
    copy_tree(src)
    plant_stale_module(src, "backends/rocm", "hwgraph_rocm")
    python_that_only_builds(tmp_path / "bin")
    wheels = tmp_path / "wheels"
    done = subprocess.run([BASH, "ci/install_extra.sh", str(wheels), "rocm", "--offline"], cwd=src,
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    names = wheel_names(wheels, "hwgraph_backend_rocm")
    assert "hwgraph_rocm/platform.py" in names
    assert "hwgraph_rocm/removed_since.py" not in names, names


def test_pkg_check_builds_wheels_without_what_an_earlier_build_left(tmp_path):
    """The pkg env exists to catch a module the wheel lacks; a stale build/lib hid it (and shipped removed ones)."""
    src = tmp_path / "src"
    copy_tree(src)
    plant_stale_module(src, ".", "hwgraph")
    plant_stale_module(src, "backends/npu", "hwgraph_npu")
    python_that_only_builds(tmp_path / "bin")
    work = tmp_path / "pkg"
    done = subprocess.run([BASH, "ci/pkg_check.sh", str(work)], cwd=src, capture_output=True, text=True,
                          timeout=600, env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    core = wheel_names(work / "wheels", "hwgraph")
    assert "hwgraph/registry.py" in core and "hwgraph/removed_since.py" not in core, core
    assert "hwgraph_npu/removed_since.py" not in wheel_names(work / "wheels", "hwgraph_backend_npu")


@pytest.mark.parametrize("step", ["bench", "compile"])
def test_h200_sh_fails_when_a_step_it_ran_failed(tmp_path, step):
    """ci/h200.sh's status counted the tests and validate only: a crashed benchmark (or compiled-replay run) ended
    with status 0, behind the `| tee` that hides its own exit status."""
    root = tmp_path / "checkout"
    (root / "ci").mkdir(parents=True)
    shutil.copy(ROOT / "ci" / "h200.sh", root / "ci" / "h200.sh")
    bin_dir = tmp_path / "bin"
    # the command line runs as python3 -m hwgraph.cli (a bare hwgraph on PATH may belong to another Python)
    failing = {"compile": "*explore.py*", "bench": "*hwgraph.cli\\ bench*"}[step]
    stand_in(bin_dir, "python3", f'case "$*" in {failing}) exit 3;; esac\nexit 0\n')
    stand_in(bin_dir, "nvidia-smi", "exit 0\n")
    done = subprocess.run([BASH, "ci/h200.sh", step], cwd=root, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert done.returncode != 0, (done.stdout, done.stderr)
