"""Detect the accelerator this process runs on: kind, device name, architecture and versions.

``detect()`` is explicit and side-effect free where the vendor allows it: importing this module imports no
vendor SDK. ROCm is told from CUDA by ``torch.version.hip``; an NPU by an importable ``torch_npu`` with a device.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from dataclasses import asdict, dataclass

import torch

KINDS = ("cuda", "rocm", "npu", "cpu")


@dataclass(frozen=True)
class PlatformInfo:
    kind: str  # one of KINDS
    device_name: str | None
    arch: str | None  # "sm_90", "gfx942", "Ascend910B", None on CPU
    torch_version: str
    runtime: str | None  # "CUDA", "HIP", "CANN"
    runtime_version: str | None
    device_count: int
    notes: tuple[str, ...] = ()  # why a present SDK was not used, e.g. "torch_npu imports but sees no NPU"

    def as_dict(self) -> dict:
        return asdict(self)


def npu_import():
    """``(torch_npu, None)`` if it is importable (already imported or installed); ``(None, why)`` where an installed
    one does not import (``ImportError: libascendcl.so: ...`` where the CANN toolkit's environment is not set);
    ``(None, None)`` where it is not installed."""
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"], None
    if importlib.util.find_spec("torch_npu") is None:
        return None, None
    try:
        return importlib.import_module("torch_npu"), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def torch_npu_unavailable(failure: str | None) -> str:
    """Why torch_npu cannot be used, and what to do, from ``npu_import()``'s ``failure`` (None: not installed)."""
    if failure is not None:
        return (f"torch_npu is installed but does not import ({failure}); set the CANN toolkit's environment "
                f"(source its set_env.sh, e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)")
    return f"torch_npu is not installed; install torch_npu built for torch {torch.__version__} with CANN"


def torch_npu_installed() -> bool:
    """Whether torch_npu is installed (imported, or found without importing it), whether or not it imports."""
    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"] is not None  # None: its import is blocked
    return importlib.util.find_spec("torch_npu") is not None


def cpu_torch_reason(backend: str, gpus: str, build: str) -> str:
    """Why the GPU backend ``backend`` (serving ``gpus``, which need a ``build`` build of torch) refuses a CPU-only
    torch. On an Ascend machine whose NPU is not usable (torch_npu installed) a GPU build of torch would break
    torch_npu, which needs this one: the npu backend is named instead."""
    if torch_npu_installed():
        return (f"torch {torch.__version__} is a CPU-only build, as torch_npu needs: the {backend} backend serves "
                f"{gpus}; for an Ascend NPU use the npu backend (its reason says what it lacks)")
    return f"torch {torch.__version__} is a CPU-only build; install a {build} build of torch"


def npu_module():
    """The ``torch_npu`` module if it is importable (already imported or installed), else None."""
    return npu_import()[0]


def npu_info(notes: list[str]) -> PlatformInfo | None:
    mod, failure = npu_import()
    if mod is None:
        if failure is not None:
            notes.append(f"torch_npu is installed but does not import ({failure})")
        return None
    npu = getattr(torch, "npu", None) or getattr(mod, "npu", None)
    try:
        count = int(npu.device_count()) if npu is not None else 0
    except Exception as exc:
        notes.append(f"torch_npu imports but cannot count devices ({exc})")
        return None
    if count == 0:
        notes.append("torch_npu imports but sees no NPU device")
        return None
    try:  # a runtime that counts its devices may still fail to describe them: a note, as a failed count is
        name = npu.get_device_name(0) if hasattr(npu, "get_device_name") else "Ascend NPU"
    except Exception as exc:
        notes.append(f"torch_npu counts {count} NPU(s) but cannot name the first ({exc})")
        return None
    # torch_npu names an NPU " " where CANN reads no SoC name (aclrtGetSocName returns null): ``" ".split()[0]``
    # raised IndexError out of every detect(). The NPU still serves, unnamed, as where its SoC version is unreadable.
    name = "" if name is None else str(name).strip()
    if not name:
        notes.append("torch_npu gives the first NPU no name (CANN could not read its SoC name)")
    arch = name.split()[0] if name else None
    # torch_npu.version holds only __version__ and git_version (torch_npu's own); CANN's comes from the runtime
    cann = optional_answer(npu, "get_cann_version", notes, "the CANN version")
    soc = optional_answer(npu, "get_soc_version", notes, "the SoC version")
    return PlatformInfo("npu", name or None, arch, torch.__version__, "CANN", None if cann is None else str(cann),
                        count, tuple(notes) + (() if soc is None else (f"soc version {soc}",)))


def optional_answer(npu, method: str, notes: list[str], what: str):
    """``npu.<method>()``, or None where torch_npu lacks it or it fails (a note says so: the NPU still serves)."""
    call = getattr(npu, method, None)
    if not callable(call):
        return None
    try:
        return call()
    except Exception as exc:
        notes.append(f"torch_npu cannot read {what} ({type(exc).__name__}: {exc})")
        return None


def cuda_info(notes: list[str]) -> PlatformInfo | None:
    """CUDA or ROCm (both answer through ``torch.cuda``); None without a visible device."""
    hip = getattr(torch.version, "hip", None)
    if not hip and not torch.version.cuda:
        return None
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        notes.append(f"torch.cuda failed to count devices ({exc})")
        return None
    if count == 0:
        notes.append(f"torch is a {'ROCm' if hip else 'CUDA'} build but no device is visible")
        return None
    try:
        props = torch.cuda.get_device_properties(0)
    except Exception as exc:
        notes.append(f"torch.cuda counts {count} device(s) but cannot read the first one's properties ({exc})")
        return None
    if hip:
        return PlatformInfo("rocm", props.name, gpu_arch(props, "rocm"), torch.__version__, "HIP", str(hip), count,
                            tuple(notes))
    return PlatformInfo("cuda", props.name, gpu_arch(props, "cuda"), torch.__version__, "CUDA", torch.version.cuda,
                        count, tuple(notes))


def gpu_arch(props, kind: str) -> str | None:
    """The architecture gates compare against, from ``torch.cuda.get_device_properties``: ROCm's full gcnArchName
    (None when unreadable), CUDA's ``sm_<major><minor>``."""
    if kind == "rocm":
        return getattr(props, "gcnArchName", None) or None
    return f"sm_{props.major}{props.minor}"


def device_type(kind: str) -> str:
    """torch's device type for the devices of platform kind ``kind`` (ROCm builds of torch call AMD GPUs cuda)."""
    return "cuda" if kind == "rocm" else kind


def runs_on_host(device: torch.device | str) -> bool:
    """Whether ``device`` is the CPU (or meta, which allocates nothing): a CPU job, whatever accelerator the machine
    has."""
    return torch.device(device).type in ("cpu", "meta")


def device_runtime(device: torch.device):
    """The torch namespace of ``device``'s accelerator (``torch.cuda``, ``torch.npu``, ...); None for the CPU or a
    device type torch has no namespace for."""
    return getattr(torch, device.type, None) if device.type != "cpu" else None


def checked_device(spec: str | torch.device, name: str = "device", purpose: str = "hwgraph") -> torch.device:
    """``spec`` as a ``torch.device`` this machine has (``cpu``, ``cuda``, ``cuda:1``, ``npu:0``), else
    ``ValueError`` naming ``name``, the value and what was expected; ``purpose`` says what it is for."""
    # importing torch_npu is what registers the device type "npu" with torch: without it torch.device("npu") fails
    if str(spec).partition(":")[0] == "npu":
        module, failure = npu_import()
        if module is None:
            raise ValueError(f"{name} {str(spec)!r}: npu devices need torch_npu, and {torch_npu_unavailable(failure)}")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{name} {spec!r} is not a torch device: expected e.g. cpu, cuda, cuda:1 or npu:0 "
                         f"({exc})") from None
    if device.type == "cpu":
        return device
    if device.type == "hip":  # torch parses it, but ROCm builds of torch run AMD GPUs as cuda devices only
        raise ValueError(f"{name} {str(spec)!r}: ROCm builds of torch address AMD GPUs as cuda devices; expected "
                         f"{str(device).replace('hip', 'cuda', 1)!r}")
    runtime = device_runtime(device)
    if device.type == "meta" or runtime is None or not callable(getattr(runtime, "is_available", None)):
        raise ValueError(f"{name} {str(spec)!r} cannot run {purpose}: expected an accelerator device (cuda, npu, "
                         f"...) or cpu")
    if not runtime.is_available():
        raise ValueError(f"{name} {str(spec)!r}: this torch ({torch.__version__}) sees no {device.type} device")
    count = runtime.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{name} {str(spec)!r}: this machine has {count} {device.type} device(s), "
                         f"indices 0..{count - 1}")
    return device


def check_materialised(tower: torch.nn.Module) -> None:
    """``ValueError`` naming the tower's tensors on the meta device (built under ``torch.device("meta")`` and not
    loaded): they hold no data, and a manager on them failed later on whatever touched them first."""
    on_meta = [name for name, t in (*tower.named_parameters(), *tower.named_buffers()) if t.is_meta]
    if on_meta:
        more = f" and {len(on_meta) - 3} more" if len(on_meta) > 3 else ""
        raise ValueError(f"the tower's {', '.join(on_meta[:3])}{more} are on the meta device (no data: built under "
                         f"torch.device('meta') or set_default_device('meta') and not loaded): load its weights first "
                         f"(Qwen3OmniVisionTower.from_pretrained, or load_state_dict(..., assign=True))")


def platform_for(device: torch.device | str) -> PlatformInfo:
    """The platform that serves ``device``: a CPU (or meta) tensor on a GPU machine is a CPU job, and a GPU named by
    index is described by its own name and architecture (``detect()`` describes device 0; a host may mix GPUs, and
    gates judge the architecture)."""
    info = detect()
    device = torch.device(device)
    if runs_on_host(device) and info.kind != "cpu":
        return PlatformInfo("cpu", "cpu", None, info.torch_version, None, None, 0)
    if info.kind in ("cuda", "rocm") and device.type == "cuda":
        try:
            # "cuda" without an index is the current GPU (what the graph backend and tower.to() resolve it to)
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index == 0:
                return info
            props = torch.cuda.get_device_properties(index)
        except Exception:  # an index this machine lacks: the backend's device check says so
            return info
        return dataclasses.replace(info, device_name=props.name, arch=gpu_arch(props, info.kind))
    return info


def detect() -> PlatformInfo:
    """Which accelerator this process would use, with the facts capability gates compare against."""
    notes: list[str] = []
    info = cuda_info(notes) or npu_info(notes)
    if info is not None:
        return info
    return PlatformInfo("cpu", "cpu", None, torch.__version__, None, None, 0, tuple(notes))
