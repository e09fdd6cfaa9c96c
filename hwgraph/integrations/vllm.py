"""vLLM's encoder CUDA graph protocol for the hwgraph Qwen3-Omni image tower, and a single-replay manager.

- ``Qwen3OmniEncoderCudaGraphAdapter`` implements vLLM's ``SupportsEncoderCudaGraph`` for a
  ``Qwen3OmniVisionTower``: its buffers are the tower's host metadata (pixel rows, position-embedding indices and
  weights, rotary positions, ``cu_seqlens``), so nothing on the replay path reads the device. Outputs follow vLLM's
  Qwen3 models: one ``[tokens, out_hidden * (1 + deepstack)]`` tensor per image, embeddings then DeepStack features.
- ``SingleReplayEncoderCudaGraphManager`` subclasses vLLM's ``EncoderCudaGraphManager``: a step replays only when
  one captured graph holds all its images (count and tokens), otherwise the whole group runs as one eager call;
  graphs are captured through hwgraph's backend registry, so the same code serves CUDA, ROCm and NPU.

Needs ``vllm`` (``pip install 'hwgraph[vllm]'``); the supported versions are ``SUPPORTED_VLLM``. Importing
``hwgraph`` never imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, ClassVar, Literal

import torch

log = logging.getLogger(__name__)

# The version gate runs first: everything below needs vLLM, and only a checked version.
from hwgraph.integrations.vllm_version import (  # noqa: E402, F401
    ALLOW_UNSUPPORTED_ENV,
    INSTALL_HINT,
    SUPPORTED_VLLM,
    VLLM_VERSION,
    UnsupportedVllmError,
    check_vllm_version,
)

# isort: split
from vllm.v1.worker.encoder_cudagraph_defs import (  # noqa: E402
    EncoderCudaGraphCaptureInputs,
    EncoderCudaGraphConfig,
    EncoderCudaGraphReplayBuffers,
    EncoderItemSpec,
)

from hwgraph import budgets as budget_rules  # noqa: E402
from hwgraph.manager import check_tower  # noqa: E402
from hwgraph.models.qwen3_omni.metadata import TENSOR_FIELDS, VisionMetadata, normalize_grid  # noqa: E402
from hwgraph.models.qwen3_omni.output import VisionOutput  # noqa: E402

PIXELS = "pixel_values"
EMBEDS = "image_embeds"  # vLLM's enable_mm_embeds: precomputed rows, [tokens, width], nothing to encode
GRID = "image_grid_thw"
DEVICE_GRID_FIX = (f"declare {GRID} as MultiModalFieldConfig.batched(\"image\", keep_on_cpu=True) in the model's "
                   f"multimodal processor (_get_mm_fields_config), as vLLM 0.33's Qwen-Omni thinker processor does; "
                   f"reading a device grid back would synchronise every step with the device")
BUFFER_KEYS = (PIXELS, *TENSOR_FIELDS)  # pixel rows + pos_indices, pos_weights, rotary_positions, cu_seqlens


# ---------------------------------------------------------------------------------------------------- padding
# vLLM's default replay copy zeroes a buffer and copies the new values into its leading rows (dim 0). Two of the
# tower's buffers need something else; both pad on the device, without reading it, exactly like
# ``VisionMetadata.padded``.

def pad_columns(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Position tables are ``[4, rows]``: copy ``src``'s rows into the leading columns; padding gets index 0 and
    weight 0, so padding patches add nothing."""
    if src.dim() != dst.dim() or src.shape[:-1] != dst.shape[:-1] or src.shape[-1] > dst.shape[-1]:
        raise ValueError(f"replay table {tuple(src.shape)} does not fit the captured buffer {tuple(dst.shape)}")
    dst.zero_()
    dst[..., : src.shape[-1]].copy_(src, non_blocking=True)


def pad_cu_seqlens(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Repeat the last cumulative length: zeros would make ``cu_seqlens`` decrease; repeats make the extra
    sequences empty and leave padding rows in none."""
    if src.dim() != 1 or dst.dim() != 1 or not 0 < src.shape[0] <= dst.shape[0]:
        raise ValueError(f"replay cu_seqlens {tuple(src.shape)} does not fit the captured buffer {tuple(dst.shape)}")
    n = src.shape[0]
    dst[:n].copy_(src, non_blocking=True)
    dst[n:].copy_(src[-1:].expand(dst.shape[0] - n), non_blocking=True)


PADDING_LOGICS = {"pos_indices": pad_columns, "pos_weights": pad_columns, "cu_seqlens": pad_cu_seqlens}


# ---------------------------------------------------------------------------------------------------- adapter
class Qwen3OmniEncoderCudaGraphAdapter:
    """vLLM's ``SupportsEncoderCudaGraph`` for a ``Qwen3OmniVisionTower`` (image modality, one ``default`` path).

    ``mm_kwargs`` are vLLM's image kwargs: ``pixel_values`` ``[patches, patch_row_width]`` (device, merge order)
    and ``image_grid_thw`` on the host: vLLM moves a multimodal field to the device unless the model's processor
    declares it ``keep_on_cpu=True``, which vLLM 0.33's Qwen-Omni thinker processor does for the grid (checked in its
    source). A device grid (a processor that overrides that declaration) is refused rather than read back
    (``DEVICE_GRID_FIX``).

    Auto-inferred budgets run from ``min_token_budget`` (64: the smallest image the processor makes) to
    ``max_token_budget`` (default hwgraph's uncalibrated cap, 256), clipped to the scheduler's token budget; beyond
    that cap replay is not known to beat eager.

    Not an ``nn.Module``: a model that holds the adapter does not get the tower's parameters in its own
    ``named_parameters()``, which vLLM's loader would report as not loaded from its checkpoint.

    Features are in the tower's dtype. Under encoder data parallelism (``mm_encoder_tp_mode="data"``) vLLM all-gathers
    them with empty ranks' ``torch.empty`` in the model's dtype: ``SingleReplayEncoderCudaGraphManager`` casts to it;
    with vLLM's own manager, load the tower in the model's dtype.
    """

    supports_encoder_cudagraph: ClassVar[Literal[True]] = True

    def __init__(self, tower, min_token_budget: int = budget_rules.MIN_AUTO_BUDGET,
                 max_token_budget: int | None = None):
        # transformers' encoder or vLLM's own ``visual`` failed later, inside vLLM's manager, as an AttributeError
        check_tower(tower)
        for name, value in (("min_token_budget", min_token_budget), ("max_token_budget", max_token_budget)):
            if name == "max_token_budget" and value is None:
                continue  # the default: hwgraph's uncalibrated cap
            if not budget_rules.is_int(value):
                raise ValueError(f"{name} must be an int (merged tokens), got {value!r}")
        if min_token_budget <= 0 or (max_token_budget is not None and max_token_budget < min_token_budget):
            raise ValueError(f"token budgets must satisfy 0 < min_token_budget <= max_token_budget, got "
                             f"{min_token_budget} and {max_token_budget}")
        self.tower = tower
        self.min_token_budget = int(min_token_budget)
        self.max_token_budget = None if max_token_budget is None else int(max_token_budget)

    @property
    def merge_area(self) -> int:
        return self.tower.spatial_merge_size ** 2

    @property
    def out_hidden_size(self) -> int:
        """Width of one output row: embeddings and every DeepStack feature side by side."""
        return self.tower.out_hidden_size * (1 + self.tower.num_deepstack)

    # ------------------------------------------------------------------ configuration
    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            modalities=["image"],
            buffer_keys=list(BUFFER_KEYS),
            out_hidden_size=self.out_hidden_size,
            padding_logics=dict(PADDING_LOGICS),
            max_frames_per_video=1,
        )

    def get_input_modality(self, mm_kwargs: dict[str, Any]) -> str:
        if GRID in mm_kwargs:
            return "image"
        if "video_grid_thw" in mm_kwargs:
            return "video"  # not served (modalities=["image"]); named so that the caller can route it eagerly
        raise KeyError(f"mm_kwargs hold neither {GRID!r} nor 'video_grid_thw'; keys: {sorted(mm_kwargs)}")

    def get_max_frames_per_video(self) -> int:
        return 1  # images only: Qwen's image grids have t == 1

    def get_encoder_cudagraph_budget_range(self, vllm_config) -> tuple[int, int]:
        high = self.max_token_budget or max(budget_rules.DEFAULT_CAP, self.min_token_budget)
        scheduled = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
        if isinstance(scheduled, int) and scheduled > 0:
            # the scheduler's tokens per step: most steps' images fit them. vLLM's encoder budget may admit one image
            # above it (its largest item); such a step runs eagerly rather than keep a graph that large
            high = min(high, scheduled)
        return self.min_token_budget, max(high, self.min_token_budget)

    # ------------------------------------------------------------------ items (host only)
    def encoder_cudagraph_accepts(self, mm_kwargs: dict[str, Any]) -> bool:
        """hwgraph extension: whether the group has pixels to encode (a group of precomputed ``image_embeds``,
        vLLM's ``enable_mm_embeds``, has none; the single-replay manager leaves it to ``embed_multimodal``)."""
        return PIXELS in mm_kwargs

    @staticmethod
    def embeds_group(mm_kwargs: dict[str, Any] | None) -> bool:
        """Whether the group is precomputed ``image_embeds`` (no pixels). vLLM's own manager, which knows no
        ``encoder_cudagraph_accepts``, still hands such a group to the protocol: select, replay buffers, eager and
        postprocess then pass the embeddings through (a replay still runs, on the buffers as they are, and is
        ignored), so that the group gets what ``embed_multimodal`` gives it (in the tower's dtype) instead of an error
        in the engine."""
        return mm_kwargs is not None and PIXELS not in mm_kwargs and EMBEDS in mm_kwargs

    def embeds(self, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        """The group's ``image_embeds``, checked against the grid's token counts (shapes only), as they are."""
        embeds, grid = mm_kwargs[EMBEDS], self.host_grid(mm_kwargs)
        tokens = sum(t * h * w for t, h, w in grid) // self.merge_area
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[0] != tokens:
            raise ValueError(f"image_embeds must be one [tokens, width] tensor with the {tokens} rows of grids "
                             f"{list(grid)}, got {getattr(embeds, 'shape', type(embeds).__name__)}")
        return embeds

    def embeds_features(self, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        """The group's ``image_embeds`` as features: in the tower's dtype, as vLLM's Qwen models cast them
        (``image_embeds.type(self.visual.dtype)``). Under encoder data parallelism vLLM's manager all-gathers them
        beside other ranks' features; as given (float32 embeddings beside a bfloat16 tower) they made ranks send
        different dtypes."""
        return self.embeds(mm_kwargs).to(self.tower.dtype)

    def pixels(self, mm_kwargs: dict[str, Any]) -> torch.Tensor:
        if PIXELS not in mm_kwargs:
            raise ValueError(f"mm_kwargs hold no {PIXELS!r} (keys: {sorted(mm_kwargs)}): a group of precomputed "
                             f"image_embeds has nothing to encode; the model's embed_multimodal must take it")
        pixels = mm_kwargs[PIXELS]
        # None went on to the replay buffers, where vLLM's copy skips a None value: the graph replayed the previous
        # group's pixels and handed back its features
        self.tower.check_pixel_tensor(pixels)
        return pixels

    def host_grid(self, mm_kwargs: dict[str, Any]) -> tuple[tuple[int, int, int], ...]:
        """The image grids as host ints; ``ValueError`` for a device tensor (reading it would sync)."""
        if GRID not in mm_kwargs:
            raise KeyError(f"mm_kwargs hold no {GRID!r} (image modality only); keys: {sorted(mm_kwargs)}")
        grid = mm_kwargs[GRID]
        rows = [grid] if isinstance(grid, torch.Tensor) else grid if isinstance(grid, (list, tuple)) else []
        on_device = {str(t.device) for t in rows if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
        if on_device:
            raise ValueError(f"mm_kwargs[{GRID!r}] is on {', '.join(sorted(on_device))}, not the host: "
                             f"{DEVICE_GRID_FIX}")
        try:  # len() of a tensor is its host shape: no device read
            empty = len(grid) == 0
        except TypeError:  # a 0-d tensor or a scalar: normalize_grid names it
            empty = False
        if empty:
            return ()
        return normalize_grid(grid, self.tower.spatial_merge_size)

    def get_encoder_cudagraph_item_specs(self, mm_kwargs: dict[str, Any]) -> list[EncoderItemSpec]:
        return [EncoderItemSpec(input_size=t * h * w, output_tokens=t * h * w // self.merge_area)
                for t, h, w in self.host_grid(mm_kwargs)]

    def get_encoder_cudagraph_item_frames(self, mm_kwargs: dict[str, Any]) -> list[int]:
        """hwgraph extension: frames (t) per item, so that the single-replay manager sends t > 1 eagerly."""
        return [t for t, _, _ in self.host_grid(mm_kwargs)]

    def select_encoder_cudagraph_items(self, mm_kwargs: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        grid = self.host_grid(mm_kwargs)
        key, per_row = (EMBEDS, self.merge_area) if self.embeds_group(mm_kwargs) else (PIXELS, 1)
        pixels = self.embeds(mm_kwargs) if key == EMBEDS else self.pixels(mm_kwargs)  # rows to slice per item
        starts = [0]
        for t, h, w in grid:
            starts.append(starts[-1] + t * h * w // per_row)
        if key == PIXELS:  # as the replay and eager paths check them (a [1, patches, width] tensor was named by its
            # rows); slicing by the grid's offsets needs exactly the grid's rows
            self.tower.check_pixel_rows(pixels, grid, starts[-1])
        if any(not 0 <= i < len(grid) for i in indices):
            raise IndexError(f"item indices {list(indices)} out of range for {len(grid)} images")
        if not indices:
            selected = pixels[:0]
        elif list(indices) == list(range(indices[0], indices[-1] + 1)):
            selected = pixels[starts[indices[0]]:starts[indices[-1] + 1]]  # consecutive, in order: a view, no copy
        else:
            selected = torch.cat([pixels[starts[i]:starts[i + 1]] for i in indices])
        return {key: selected, GRID: [grid[i] for i in indices]}

    # ------------------------------------------------------------------ buffers
    def prepare_encoder_cudagraph_capture_inputs(
        self,
        token_budget: int,
        max_batch_size: int,
        max_frames_per_batch: int,
        device: torch.device,
        dtype: torch.dtype,
        path: str = "default",
        axis_keys: tuple[Hashable, ...] | None = None,
    ) -> EncoderCudaGraphCaptureInputs:
        """Static buffers for one budget: ``token_budget * merge**2`` pixel rows and room for
        ``max(max_batch_size, max_frames_per_batch)`` sequences. One image filling the budget gives the worst-case
        ``max_seqlen``, which the forward fixes to the row count (a host int baked into the graph)."""
        self._check_path(path)
        num_patches = token_budget * self.merge_area
        num_seqs = max(max_batch_size, max_frames_per_batch, 1)
        grid = [budget_rules.filling_grid(token_budget, self.tower.spatial_merge_size)]
        # Fresh tensors per call (prepare_metadata returns cached ones, padded copies them): vLLM keeps these exact
        # objects as the graph's inputs and copies each replay's values into them.
        metadata = self.tower.prepare_metadata(grid).padded(num_patches, num_seqs).to(device)
        # In the tower's dtype, as the eager forward casts them (encoder_eager_forward), not in vLLM's ``dtype``:
        # a bf16 buffer in front of a float32 tower would round every replay's pixels, and eager's not.
        pixels = torch.zeros(num_patches, self.tower.patch_row_width, device=device, dtype=self.tower.dtype)
        return EncoderCudaGraphCaptureInputs(values={PIXELS: pixels, **metadata.tensors()})

    def prepare_encoder_cudagraph_replay_buffers(
        self,
        mm_kwargs: dict[str, Any],
        max_batch_size: int,
        max_frames_per_batch: int,
        path: str = "default",
    ) -> EncoderCudaGraphReplayBuffers:
        """This step's values, unpadded: ``PADDING_LOGICS`` and vLLM's default copy pad them into the buffers.
        ``ValueError`` unless ``pixel_values`` is ``[patches of the grid, patch_row_width]`` (shapes only)."""
        self._check_path(path)
        if self.embeds_group(mm_kwargs):  # None leaves every buffer as it is; postprocess takes the embeddings
            self.embeds(mm_kwargs)
            return EncoderCudaGraphReplayBuffers(values=dict.fromkeys(BUFFER_KEYS))
        # The default copy zero-pads: missing rows would replay as zero pixels and give a wrong answer, not an error.
        # They are checked before the metadata's tables, which grow with the grids, are built.
        pixels = self.pixels(mm_kwargs)
        metadata = self.tower.prepare_metadata(self.host_grid(mm_kwargs), pixels)
        slots = max(max_batch_size, max_frames_per_batch, 1)  # as prepare_encoder_cudagraph_capture_inputs sized them
        if metadata.num_frames > slots:  # else pad_cu_seqlens refused it, naming only the two buffers' shapes
            raise ValueError(f"grids {list(metadata.grid_thw)} have {metadata.num_frames} frames (one attention "
                             f"sequence each), more than the {slots} sequence slots of the captured graphs "
                             f"(max(max_batch_size, max_frames_per_batch)); Qwen's image processor makes grids with "
                             f"t == 1, and SingleReplayEncoderCudaGraphManager runs a group with t > 1 eagerly")
        metadata = metadata.to(self.tower.device)
        return EncoderCudaGraphReplayBuffers(values={PIXELS: pixels, **metadata.tensors()})

    # ------------------------------------------------------------------ forwards
    def encoder_cudagraph_forward(self, inputs: dict[str, torch.Tensor], path: str = "default") -> torch.Tensor:
        """The captured forward: ``[rows / merge**2, out_hidden_size]`` from the static buffers (padding rows
        included). ``max_seqlen`` is the buffer's row count, the value every replay keeps."""
        self._check_path(path)
        missing = [k for k in BUFFER_KEYS if k not in inputs]
        if missing:
            raise KeyError(f"encoder_cudagraph_forward is missing buffers {missing}; got {sorted(inputs)}")
        pixels = inputs[PIXELS]
        metadata = VisionMetadata(
            grid_thw=(), spatial_merge_size=self.tower.spatial_merge_size,  # buffers describe no image in particular
            num_grid_per_side=self.tower.num_grid_per_side,
            max_seqlen=int(pixels.shape[0]), patch_counts=(), token_counts=(),
            **{k: inputs[k] for k in TENSOR_FIELDS},
        )
        return self.concat(self.tower.forward_with_metadata(pixels, metadata))

    def encoder_eager_forward(self, mm_kwargs: dict[str, Any], path: str = "default") -> torch.Tensor:
        """The tower's eager forward on the group: ``[tokens, out_hidden_size]``."""
        self._check_path(path)
        if self.embeds_group(mm_kwargs):
            return self.embeds_features(mm_kwargs)
        # Checked as given, before the cast, as the replay buffers check them: cast first, integer pixels (raw uint8
        # values, say) passed here while the same group in a graph was refused.
        # On the tower's device, as vLLM's own tower moves them and the replay path copies them: host pixels given to
        # a GPU tower replayed, and failed with a device mismatch once their group ran eagerly.
        pixels = self.pixels(mm_kwargs).to(self.tower.device)
        metadata = self.tower.prepare_metadata(self.host_grid(mm_kwargs), pixels)
        return self.concat(self.tower.forward_with_metadata(pixels.to(self.tower.dtype), metadata))

    def postprocess_encoder_output(
        self,
        outputs: dict[str, torch.Tensor],
        indices: list[int],
        per_item_out_tokens: list[int],
        dest: dict[int, torch.Tensor] | list[torch.Tensor | None],
        clone: bool = False,
        batch_mm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Slice each image's rows (embeddings and DeepStack, side by side) out of ``outputs['default']`` into
        ``dest[index]``; rows after the last image are padding and dropped. ``clone`` when the rows live in a
        graph buffer that the next replay overwrites."""
        out = self.embeds_features(batch_mm_kwargs) if self.embeds_group(batch_mm_kwargs) else outputs["default"]
        counts = [per_item_out_tokens[i] for i in indices]
        if sum(counts) > out.shape[0]:
            raise ValueError(f"{sum(counts)} output tokens for items {list(indices)} exceed the {out.shape[0]} "
                             f"rows the encoder returned")
        start = 0
        for index, n in zip(indices, counts, strict=True):
            rows = out[start:start + n]
            dest[index] = rows.clone() if clone else rows
            start += n

    # ------------------------------------------------------------------ conversions
    def concat(self, output: VisionOutput) -> torch.Tensor:
        """``VisionOutput`` -> ``[tokens, out_hidden * (1 + deepstack)]``, the layout vLLM's Qwen3 models use."""
        return torch.cat((output.embeds, *output.deepstack), dim=1)

    def split(self, features: torch.Tensor) -> VisionOutput:
        """The inverse of ``concat``: views of the embeddings and each DeepStack feature."""
        if features.dim() != 2 or features.shape[1] != self.out_hidden_size:
            raise ValueError(f"expected [tokens, {self.out_hidden_size}] features, got {tuple(features.shape)}")
        embeds, *deepstack = features.split(self.tower.out_hidden_size, dim=1)
        return VisionOutput(embeds, tuple(deepstack))

    @staticmethod
    def _check_path(path: str) -> None:
        if path != "default":
            raise ValueError(f"the Qwen3-Omni image tower has one encoder path, 'default'; got {path!r}")


# The manager lives in its own module (one concept per module); importing it here keeps one import path.
from hwgraph.integrations.vllm_manager import (  # noqa: E402, F401
    ReplayDecision,
    SingleReplayEncoderCudaGraphManager,
    install_single_replay_manager,
)

__all__ = ["BUFFER_KEYS", "PADDING_LOGICS", "SUPPORTED_VLLM", "VLLM_VERSION", "Qwen3OmniEncoderCudaGraphAdapter",
           "ReplayDecision", "SingleReplayEncoderCudaGraphManager", "UnsupportedVllmError", "check_vllm_version",
           "install_single_replay_manager", "pad_columns", "pad_cu_seqlens"]
