"""What the four distributions ship in their sdists: the license they declare, and the tests (with what those need) so
that a packager can run them from the sdist alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None or not (ROOT / ".git").exists(),
                                reason="copies the checkout's files as git lists them; no git checkout here")
DISTRIBUTIONS = {".": ("tests/conftest.py", "tests/plugins", "ci/env.sh", "tox.ini"),
                 "backends/cuda": ("tests/test_cuda_conformance.py",),
                 "backends/rocm": ("tests/test_rocm_conformance.py",),
                 "backends/npu": ("tests/test_npu_conformance.py",)}


def copy_checkout(dest: Path) -> None:
    """The checkout's files as git lists them (tracked, and untracked but not ignored), copied into ``dest``."""
    listed = subprocess.run([GIT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


class Sdist(NamedTuple):
    names: list[str]  # member names without the top folder
    pkg_info: str  # its PKG-INFO: the metadata an index shows


@pytest.fixture(scope="module")
def sdists(tmp_path_factory) -> dict[str, Sdist]:
    """Each distribution's sdist, built from a copy of the checkout so the build writes no egg-info beside the tests
    that run meanwhile."""
    work = tmp_path_factory.mktemp("sdist")
    copy_checkout(work / "src")
    members = {}
    for dist in DISTRIBUTIONS:
        out = work / "out" / dist.replace("/", "-")
        subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "b.build_sdist(sys.argv[1])", str(out)], cwd=work / "src" / dist, check=True,
                       capture_output=True, timeout=300)
        (archive,) = out.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            (info,) = [m for m in names if m.count("/") == 1 and m.endswith("/PKG-INFO")]
            members[dist] = Sdist([m.split("/", 1)[1] for m in names if "/" in m],
                                  tar.extractfile(info).read().decode())
    return members


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_every_sdist_carries_its_license_and_its_tests(sdists, dist):
    names = sdists[dist].names
    assert "LICENSE" in names, f"{dist}: declares Apache-2.0 but ships no LICENSE"
    for needed in DISTRIBUTIONS[dist]:
        assert any(n == needed or n.startswith(needed + "/") for n in names), f"{dist}: sdist lacks {needed}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")], f"{dist}: sdist carries bytecode"


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_every_distribution_describes_itself_on_its_index_page(sdists, dist):
    """The README is the long description (what PyPI shows): each plugin names itself and what it provides."""
    assert "README.md" in sdists[dist].names, f"{dist}: sdist lacks README.md"
    info = sdists[dist].pkg_info
    assert "Description-Content-Type: text/markdown" in info, f"{dist}: no markdown long description"
    name = next(line.split(": ", 1)[1] for line in info.splitlines() if line.startswith("Name: "))
    body = info.split("\n\n", 1)[1]
    assert body.startswith(f"# {name}\n"), f"{dist}: long description does not start with the distribution's name"
    if dist != ".":
        assert "pytest backends/" in body and "tox -e" in body, f"{dist}: readme does not say how to test it"


def test_the_license_files_are_the_apache_2_0_text_they_declare():
    for dist in DISTRIBUTIONS:
        text = (ROOT / dist / "LICENSE").read_text()
        assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text, dist
        assert 'license = "Apache-2.0"' in (ROOT / dist / "pyproject.toml").read_text(), dist


def test_the_root_sdist_carries_the_plugin_sources_every_tox_env_installs(sdists):
    """Each tox env runs ci/install_extra.sh, which builds backends/<vendor>; the sdist used to leave backends/ out,
    so tox run from it stopped at `Invalid requirement: 'backends/cuda'`."""
    names = sdists["."].names
    for vendor in ("cuda", "rocm", "npu"):
        assert f"backends/{vendor}/pyproject.toml" in names, f"root sdist lacks backends/{vendor}"
        assert f"backends/{vendor}/hwgraph_{vendor}/__init__.py" in names, f"root sdist lacks hwgraph_{vendor}"
    assert not [n for n in names if ".egg-info/" in n and n.startswith("backends/")], "sdist carries build metadata"


def test_the_torch_requirement_admits_the_nvidia_container_build_the_cuda_gate_accepts():
    """NVIDIA's containers ship torch as 2.10.0a0+<commit>.nv<yy.mm>. The cuda gate counts it as 2.10, but
    `torch>=2.10` excludes it under PEP 440 (2.10.0a0 < 2.10): pip would replace the vendor's build."""
    from packaging.requirements import Requirement

    from hwgraph.graphs.torch_cuda import torch_version_capability

    tomllib = pytest.importorskip("tomllib", reason="no tomllib before Python 3.11: pyproject.toml is not read")

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_req,) = [Requirement(r) for r in data["project"]["dependencies"] if Requirement(r).name == "torch"]
    for found, wanted in (("2.10.0a0+5b7de7e.nv25.11", True), ("2.10.0", True), ("2.13.0+cpu", True),
                          ("2.9.1", False), ("2.9.0a0+abc.nv25.01", False)):
        assert torch_req.specifier.contains(found) is wanted, (str(torch_req), found)
        assert torch_version_capability("cuda", found).ok is wanted, found


def test_a_reused_environment_gets_the_plugin_code_of_the_checkout(tmp_path):
    """tox reuses its env: on a second run ci/install_extra.sh built the edited plugin's wheel, but pip kept the
    hwgraph-backend-cuda 0.1.0 the first run had installed (every plugin is 0.1.0), so the tests imported stale code.
    Here the env also sees this interpreter's packages, where a plugin 0.1.0 is installed too: before the fix pip kept
    that one already on the first run, and the env could not import the plugin at all."""
    if shutil.which("bash") is None:
        pytest.skip("ci/install_extra.sh is a bash script; no bash on this machine")
    src = tmp_path / "src"
    copy_checkout(src)
    env = tmp_path / "env"  # as tox makes it: this interpreter's packages (torch, setuptools, pip) seen, not owned
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    seen = [p for p in sys.path if p.endswith("site-packages")]
    (Path(purelib) / "_seen.pth").write_text("\n".join(seen) + "\n")
    path = f"{env / 'bin'}:/usr/bin:/bin"

    def install_and_read() -> str:
        wheels = tmp_path / "wheels"  # tox empties {envtmpdir} on each run
        shutil.rmtree(wheels, ignore_errors=True)
        done = subprocess.run(["bash", "ci/install_extra.sh", str(wheels), "cuda", "--offline"], cwd=src,
                              capture_output=True, text=True, timeout=600, env={"PATH": path, "HOME": str(tmp_path)})
        assert done.returncode == 0, done.stderr
        return subprocess.run([str(python), "-c", "import hwgraph_cuda.platform as p; print(p.__file__, "
                               "getattr(p, 'MARKER', None))"], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.split()

    first_file, marker = install_and_read()
    assert first_file.startswith(str(env)) and marker == "None", (first_file, marker)
    with open(src / "backends" / "cuda" / "hwgraph_cuda" / "platform.py", "a") as f:
        f.write("\nMARKER = 'edited'\n")
    assert install_and_read() == [first_file, "edited"]


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


def test_tox_commands_keep_a_checkout_path_with_spaces_one_argument():
    """tox 4 substitutes {envtmpdir} and {env_python} into a command and then splits it as a shell would
    (``StrConvert.to_command``: shlex, after substitution), so in a checkout at `/ci/my checkout` the scripts got
    `/ci/my` and `checkout/.tox/...` as two arguments and refused them (`expected WORKDIR`, `expected WHEELDIR ...`)."""
    import configparser
    import shlex

    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    base = "/ci/my checkout/.tox/env"
    split = {}
    for name, section in ini.items():
        for key in ("commands_pre", "commands"):
            for line in filter(None, section.get(key, "").splitlines()):
                value = (line.replace("{envtmpdir}", f"{base}/tmp").replace("{env_python}", f"{base}/bin/python")
                         .replace("{posargs}", ""))
                lexer = shlex.shlex(value, posix=True)
                lexer.whitespace_split, lexer.commenters = True, ""
                args = list(lexer)
                if any("/ci/my" in a and base not in a for a in args):
                    split[f"{name}.{key}"] = args
    assert not split, split


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
