"""Load the tower from a local Hugging Face checkpoint folder (config.json + safetensors, single or sharded).

Only the vision tensors are read (a full Qwen3-Omni checkpoint is ~60 GB; its tower ~1 GB), straight onto the
target device and dtype. The tower is built on the meta device first, so no memory is spent on a random init.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from hwgraph.dtypes import graph_dtype
from hwgraph.models.qwen3_omni.config import vision_config_from_dict

# Where the tower's tensors live: a full Qwen3-Omni checkpoint, a tower saved alone, or a bare state dict; and a raw
# state_dict() of transformers' modules (save_pretrained writes the checkpoint names above), whose thinker holds the
# encoder at model.visual.
PREFIXES = ("thinker.visual.", "thinker.model.visual.", "visual.", "model.visual.", "")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the tower: the message lists what is missing or unexpected."""


@contextlib.contextmanager
def opened(file: Path, device: str = "cpu"):
    """``safetensors.safe_open(file)``; a file it cannot parse (truncated, empty, not safetensors) raises
    ``CheckpointError`` naming it (safetensors' own error does not). A missing file raises its ``OSError``."""
    from safetensors import safe_open

    try:
        handle = safe_open(file, framework="pt", device=device)
    except OSError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
    with handle as f:
        yield f


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object whose 'weight_map' maps tensor "
                                  f"names to files): {type(exc).__name__}: {exc}") from None
    files = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {folder}; "
                                f"it holds {sorted(p.name for p in folder.iterdir())}")
    out = {}
    for file in files:
        with opened(file) as f:
            for name in f.keys():
                if name in out:  # a stray file of another checkpoint: which copy is meant cannot be told
                    raise CheckpointError(f"tensor {name!r} is in both {out[name].name} and {file.name} in {folder}, "
                                          f"which has no {INDEX_FILE}: remove the files of other checkpoints")
                out[name] = file
    return out


def shorten(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def choose_prefix(available, wanted) -> str:
    """The prefix under which most of the tower's tensors are found; ``CheckpointError`` when none is."""
    available = set(available)
    hits = {prefix: sum(prefix + name in available for name in wanted) for prefix in PREFIXES}
    best = max(PREFIXES, key=lambda p: hits[p])  # ties go to the first (most specific) prefix
    if hits[best] == 0:
        raise CheckpointError(f"the checkpoint holds none of the tower's tensors under any of the prefixes "
                              f"{list(PREFIXES)} (e.g. {next(iter(wanted))!r}); it holds: {shorten(available)}")
    return best


def read_vision_tensors(folder: Path, expected: dict[str, torch.Size], device: torch.device,
                        dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tower's tensors (names without prefix), checked against ``expected`` names and shapes."""
    files = tensor_files(folder)
    prefix = choose_prefix(files, expected)
    found = {name[len(prefix):] for name in files if name.startswith(prefix)}
    missing, unexpected = set(expected) - found, found - set(expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the tower (tensor prefix {prefix!r}): "
            f"missing {len(missing)}: [{shorten(missing)}]; unexpected {len(unexpected)}: [{shorten(unexpected)}]")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[prefix + name], []).append(name)
    tensors, wrong, not_float = {}, [], []
    for file, names in by_file.items():
        with opened(file, str(device)) as f:
            # An index naming a file that lacks the tensor: safetensors' "File does not contain tensor" named neither
            absent = {prefix + name for name in names} - set(f.keys())
            if absent:
                raise CheckpointError(f"{folder / INDEX_FILE} maps {len(absent)} tensor(s) to {file.name}, which does "
                                      f"not hold them: [{shorten(absent)}]")
            for name in names:
                shape = torch.Size(f.get_slice(prefix + name).get_shape())
                if shape != expected[name]:
                    wrong.append(f"{name} {tuple(shape)} (tower {tuple(expected[name])})")
                    continue
                tensor = f.get_tensor(prefix + name)
                if not tensor.is_floating_point():  # quantized integers: a cast to dtype gave their raw values
                    not_float.append(f"{name} ({str(tensor.dtype).removeprefix('torch.')})")
                    continue
                tensors[name] = tensor if dtype is None else tensor.to(dtype)
    if wrong:
        raise CheckpointError(f"checkpoint {folder} has tensors of the wrong shape (is config.json the one "
                              f"of these weights?): {shorten(wrong)}")
    if not_float:
        raise CheckpointError(f"checkpoint {folder} holds tower tensors that are not floating point (a quantized "
                              f"checkpoint?): {shorten(not_float)}")
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    if len(dtypes) > 1:
        raise CheckpointError(f"checkpoint {folder} mixes dtypes {', '.join(dtypes)} in the tower's tensors: pass "
                              f"dtype= to load them in one")
    if dtype is None and tensors:
        try:  # a float8 checkpoint built a float8 tower, which no attention kernel or matmul here runs
            graph_dtype(next(iter(tensors.values())).dtype)
        except ValueError:
            raise CheckpointError(f"checkpoint {folder} holds the tower's tensors in {dtypes[0]}, which the tower "
                                  f"does not run in: pass dtype= (float32, bfloat16, float16 or float64) to cast "
                                  f"them") from None
    return tensors


def from_pretrained(path, dtype: torch.dtype | None = None, device=None, attention=None, tower_cls=None):
    """A tower with the weights of the local checkpoint folder ``path``.

    config.json may be a full Qwen3-Omni config, a thinker config or a vision-only config; tensors may sit
    under ``thinker.visual.``, ``visual.`` (``thinker.model.visual.``, ``model.visual.``: a transformers module's raw
    ``state_dict()``) or no prefix. ``dtype`` None keeps the checkpoint's dtype; ``device``
    defaults to the CPU. Missing, unexpected, misshapen or integer tensors raise ``CheckpointError`` listing them,
    as does, with ``dtype`` None, a checkpoint in a dtype the tower does not run in (float8).
    """
    from hwgraph.platform import checked_device, device_runtime

    if tower_cls is None:
        from hwgraph.models.qwen3_omni.tower import Qwen3OmniVisionTower as tower_cls
    # Checked first: a device this machine lacks failed while reading, in safetensors' pinned copy ("pin_memory=True
    # requires a CUDA or other accelerator backend") without naming the device.
    device = checked_device(device if device is not None else "cpu", "device", "from_pretrained")
    if device.type != "cpu" and device.index is None:
        # safetensors reads a bare "cuda" as cuda:0, torch as the current device: on a process whose current device
        # is another, the weights went to cuda:0 and the rotary frequencies to the current one
        device = torch.device(device.type, device_runtime(device).current_device())
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {folder} (expected a local Hugging Face checkpoint folder)")
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # json's and utf-8's errors name no file
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):  # a list or a string failed in dict(data), naming neither the file nor the value
        raise ValueError(f"{config_file} holds a JSON {type(data).__name__} {data!r:.80}, expected an "
                         f"object: a model config")
    config = vision_config_from_dict(data)
    if dtype is not None:
        dtype = graph_dtype(dtype)  # "bfloat16" or a floating-point dtype; anything else names the accepted ones
    with torch.device("meta"):
        tower = tower_cls(config, attention=attention)
    expected = {name: t.shape for name, t in tower.state_dict().items()}
    tower.load_state_dict(read_vision_tensors(folder, expected, device, dtype), strict=True, assign=True)
    tower.rotary_pos_emb.reset(device)  # non-persistent: not in the checkpoint, still on meta
    return tower.eval()
