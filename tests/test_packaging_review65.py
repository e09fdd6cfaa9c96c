"""Packaging gaps found in review 65: what the root sdist grafts from a developer's checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIT = shutil.which("git")


def copy_checkout(dest: Path) -> None:
    """The checkout's files as git lists them (tracked, and untracked but not ignored), copied into ``dest``."""
    listed = subprocess.run([GIT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.mark.skipif(GIT is None or not (ROOT / ".git").exists(),
                    reason="copies the checkout's files as git lists them; no git checkout here")
def test_the_root_sdist_leaves_out_what_a_plugins_test_run_or_build_leaves_in_its_folder(tmp_path):
    """`graft backends` took every file under backends/, ignored ones too: after the plugin README's `pytest
    backends/rocm` (whose rootdir is backends/rocm, so its cache lands there) the sdist shipped
    backends/rocm/.pytest_cache, and after `python -m build backends/cuda` a stale plugin wheel in
    backends/cuda/dist."""
    src = tmp_path / "src"
    copy_checkout(src)
    left = {"backends/rocm/.pytest_cache/v/cache/nodeids": "[]\n",
            "backends/cuda/dist/hwgraph_backend_cuda-0.1.0-py3-none-any.whl": "stale\n",
            "backends/npu/.ruff_cache/CACHEDIR.TAG": "Signature: 8a477f597d28d172789f06886806bc55\n"}
    for name, text in left.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                    "b.build_sdist(sys.argv[1])", str(out)], cwd=src, check=True, capture_output=True, timeout=300)
    (archive,) = out.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = [m.split("/", 1)[1] for m in tar.getnames() if "/" in m]
    assert "backends/rocm/hwgraph_rocm/__init__.py" in names  # the plugin sources still ship
    assert "backends/rocm/tests/test_rocm_conformance.py" in names
    shipped = [n for n in names if any(part in n.split("/") for part in (".pytest_cache", "dist", ".ruff_cache"))]
    assert not shipped, f"the root sdist carries what a test run or build left: {shipped}"


def tox_passes(section, environ: dict[str, str]) -> dict[str, str]:
    """What tox 4 hands a testenv of ``environ`` through its ``pass_env``: the value is one name per line (or comma
    separated when on one line), a name with ``*`` a pattern matched from the start (tox's
    ``ToxEnv.environment_variables``); nothing else passes but PATH and tox's own short default list."""
    import re

    value = section.get("pass_env", "")
    names = [n.strip() for n in value.split("\n" if "\n" in value else ",") if n.strip()]
    globs = [re.compile(n.replace("*", ".*")) for n in names if "*" in n]
    return {k: v for k, v in environ.items() if k in names or any(g.match(k) for g in globs)}


# What each vendor's runtime reads from the environment a CI job sets: the devices it was given, and on Ascend what
# the CANN toolkit's set_env.sh exports (without ASCEND_OPP_PATH ACL does not initialise: error 148049).
RUNTIME_ENV = {
    "cuda": {"CUDA_VISIBLE_DEVICES": "1"},
    "rocm": {"HIP_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "1"},
    "npu": {"ASCEND_RT_VISIBLE_DEVICES": "1", "ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
            "ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest",
            "ASCEND_OPP_PATH": "/usr/local/Ascend/ascend-toolkit/latest/opp",
            "ASCEND_AICPU_PATH": "/usr/local/Ascend/ascend-toolkit/latest",
            "TOOLCHAIN_HOME": "/usr/local/Ascend/ascend-toolkit/latest/toolkit",
            "PYTHONPATH": "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages"},
}


@pytest.mark.parametrize("accel", list(RUNTIME_ENV))
def test_tox_accelerator_envs_pass_the_vendor_runtimes_environment(accel):
    """tox 4 passes a testenv only PATH, PIP_*, proxies, LD_LIBRARY_PATH and a few more, and the accelerator envs
    added PYTHON alone: `CUDA_VISIBLE_DEVICES=1 tox -e cuda` ran on every GPU (the runner's restriction dropped), and
    on Ascend, after `source set_env.sh`, torch_npu ran without ASCEND_OPP_PATH and CANN's Python packages, so the
    env's machine check found no NPU and refused the machine it was made for."""
    import configparser

    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    section = ini[f"testenv:{accel}"]
    environ = {"PYTHON": "/opt/torch/.venv/bin/python", **RUNTIME_ENV[accel], "HWGRAPH_ATTENTION": "FLASH_ATTN"}
    passed = tox_passes(section, environ)
    assert passed == {k: v for k, v in environ.items() if k != "HWGRAPH_ATTENTION"}, sorted(passed)


def accelerator_checkout(tmp_path: Path, kind: str | None) -> tuple[Path, dict, Path]:
    """A checkout with ci/test.sh and what it sources, and a .venv made for an accelerator (the system's
    site-packages) whose python is this interpreter, except that pip does nothing and pytest only logs that it ran.
    ``kind``: what hwgraph's detection says in it (None: the real detection of this machine)."""
    root = tmp_path / "checkout"
    (root / "ci").mkdir(parents=True)
    for name in ("test.sh", "env.sh", "detect.sh", "parent_venv.sh"):
        shutil.copy(ROOT / "ci" / name, root / "ci" / name)
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = true\n")
    log = tmp_path / "ran.log"
    detect = f'case "$2" in *detect*) echo {kind}; exit 0;; esac\n' if kind else ""
    (venv_bin / "python").write_text(f'#!/bin/sh\ncase "$1 $2" in\n  "-m pip") exit 0;;\n'
                                     f'  "-m pytest") echo pytest >> {log}; exit 0;;\nesac\n'
                                     f'[ "$1" = -c ] && {{ {detect}:; }}\nexec {sys.executable} "$@"\n')
    (venv_bin / "hwgraph").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("python", "hwgraph"):
        (venv_bin / tool).chmod(0o755)
    return root, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, log


@pytest.mark.skipif(shutil.which("bash") is None, reason="ci/test.sh is a bash script; no bash on this machine")
@pytest.mark.skipif(shutil.which("nvidia-smi") or shutil.which("rocm-smi") or shutil.which("npu-smi"),
                    reason="refuses an accelerator this machine does not have; this machine has one")
@pytest.mark.parametrize("accel", ["cuda", "rocm", "npu"])
def test_test_sh_refuses_an_accelerator_hwgraph_does_not_find_here(tmp_path, accel):
    """`ci/test.sh rocm` on a machine hwgraph finds no AMD GPU on (here, a CPU one; an NVIDIA one alike) ran the
    suite with every rocm test skipped and exited 0, as `tox -e rocm` did before ci/accel_check.py refused it."""
    root, env, log = accelerator_checkout(tmp_path, None)
    done = subprocess.run(["bash", "ci/test.sh", accel], cwd=root, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"hwgraph finds a cpu machine here, so every {accel} test would be skipped" in done.stderr, done.stderr
    assert not log.exists(), "pytest ran"


@pytest.mark.skipif(shutil.which("bash") is None, reason="ci/test.sh is a bash script; no bash on this machine")
def test_test_sh_runs_the_suite_where_hwgraph_finds_the_accelerator(tmp_path):
    root, env, log = accelerator_checkout(tmp_path, "cuda")
    done = subprocess.run(["bash", "ci/test.sh", "cuda"], cwd=root, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert log.read_text() == "pytest\n"
