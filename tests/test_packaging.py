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
