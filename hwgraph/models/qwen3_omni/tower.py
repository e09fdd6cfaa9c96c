"""The graph-ready Qwen3-Omni image tower: host metadata in, device-only forward out.

``forward(pixels, grid)`` equals transformers' ``Qwen3OmniMoeVisionEncoder`` (same state dict names and shapes).
It is split so that a device graph can be captured per input size: ``prepare_metadata(grid)`` does all the
grid-dependent work on the host, ``forward_with_metadata(pixels, metadata)`` only launches device work whose
shapes depend on the metadata's shapes alone (no ``.item()``, ``.tolist()``, ``.cpu()``, or data-dependent shapes).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref

import torch
from torch import nn

from hwgraph.attention.base import ANY_HEAD_DIM, KernelSpec, VarlenAttention, check_attention_request, host_cu_seqlens
from hwgraph.capability import Capability
from hwgraph.models.qwen3_omni.config import VisionConfig, check_config, preset_config, resolve_config
from hwgraph.models.qwen3_omni.fused import add_position_embedding
from hwgraph.models.qwen3_omni.layers import AxialRotary, PatchEmbed, PatchMerger, VisionBlock
from hwgraph.models.qwen3_omni.merge_streams import thread_merge_stream
from hwgraph.models.qwen3_omni.metadata import VisionMetadata, grid_metadata, normalize_grid
from hwgraph.models.qwen3_omni.output import VisionOutput
from hwgraph.platform import KINDS, PlatformInfo, check_materialised, platform_for

log = logging.getLogger(__name__)


class _Registrations:
    """How many parameters, buffers and submodules any module of the process has been given since hwgraph was
    imported: torch's global registration hooks count them (``module.weight = nn.Parameter(...)``,
    ``load_state_dict(assign=True)``, a buffer assigned, ``tower.blocks[1] = block``). ``weights_key`` lists every
    weight's address again only when this moved."""
    count = 0

    @classmethod
    def seen(cls, module, name, value):
        cls.count += 1  # returns None: the hook changes nothing


#: each tower's weights and buffers, as its ``weights_key()`` last listed them: kept outside the tower, where the CPU
#: backend's search for the tensors a capture read (``hwgraph.graphs.read_ways``) would find them first and name them
#: by this list instead of their modules
LAYOUT_TENSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

nn.modules.module.register_module_parameter_registration_hook(_Registrations.seen)
nn.modules.module.register_module_buffer_registration_hook(_Registrations.seen)
# a submodule assigned (``tower.blocks[1] = block``): its weights are listed again too
nn.modules.module.register_module_module_registration_hook(_Registrations.seen)

AUTO = "auto"


def callable_spec(fn: VarlenAttention) -> KernelSpec:
    """A spec for a kernel passed in as a plain callable; graph-safe unless it says ``fn.graph_safe = False``,
    slot-bound (``KernelSpec.slot_bound``) if it says ``fn.slot_bound = True``, given host boundaries
    (``KernelSpec.reads_host_boundaries``) if it says ``fn.reads_host_boundaries = True``. A registered kernel's own
    function (``hwgraph.attention.triton_attn.triton_varlen``) says by default what its spec says: given as a
    callable, TRITON_ATTN was captured once per budget instead of once per slot count, and replayed slower."""
    registered = registered_spec_of(fn)

    def flag(field: str, default: bool) -> bool:
        return bool(getattr(fn, field, default if registered is None else getattr(registered, field)))

    return KernelSpec(
        name=getattr(fn, "__name__", type(fn).__name__), impl_path="", kinds=KINDS,
        dtypes=(torch.float32, torch.bfloat16, torch.float16), head_dims=ANY_HEAD_DIM,
        graph_safe=flag("graph_safe", True), gate=lambda platform: Capability.available(),
        slot_bound=flag("slot_bound", False), reads_host_boundaries=flag("reads_host_boundaries", False),
        description="a callable given to the tower" + ("" if registered is None else f", {registered.name}'s"),
    )


def registered_spec_of(fn: VarlenAttention) -> KernelSpec | None:
    """The registered kernel whose ``impl_path`` names ``fn`` itself, or None. Only modules already imported are
    looked in: ``fn``'s own is, so finding it imports no kernel's module (aiter, torch_npu)."""
    from hwgraph.attention.registry import kernel_specs

    for spec in kernel_specs():
        module, _, name = spec.impl_path.partition(":")
        if getattr(sys.modules.get(module), name, None) is fn:
            return spec
    return None


def rotary_after_load(tower: Qwen3OmniVisionTower, incompatible_keys) -> None:
    """After ``load_state_dict``: the rotary frequencies (non-persistent, in no checkpoint) on the weights' device.
    A tower built under ``torch.device("meta")`` and loaded with ``assign=True`` (meta init, then load) had real
    weights and frequencies still on meta, and its forward failed ("Tensor on device meta is not on the expected
    device cpu!"); so did a tower built on the CPU and loaded with ``assign=True`` from another device's tensors
    (frequencies on the CPU, weights on the GPU). The attention kernel is chosen again at next use, as after ``to()``:
    tensors assigned in another dtype or on another device may not be the kernel's (FLASH_ATTN chosen for bf16, then
    fp32 weights assigned, was fed fp32)."""
    weight = tower.patch_embed.proj.weight
    if weight.is_meta:
        return
    if tower.rotary_pos_emb.inv_freq.device != weight.device:
        tower.rotary_pos_emb.reset(weight.device)
    tower._attention = None  # chosen for the old device and dtype: choose again at next use


OVERLAP_MAX_ROWS = 512  # patch rows up to which DeepStack mergers overlap the blocks (merge_stream)


class Qwen3OmniVisionTower(nn.Module):
    """The Qwen3-Omni image tower. ``config``: a ``Qwen3OmniMoeVisionEncoderConfig``, a preset name, a config
    dict or a full Qwen3-Omni config. ``attention``: a kernel name, a ``VarlenAttention`` callable, or None for
    the best kernel available where the tower runs (chosen at first use, again after each ``to()``)."""

    output_type = VisionOutput

    def __init__(self, config: VisionConfig | str | dict, attention: str | VarlenAttention | None = None):
        super().__init__()
        config = resolve_config(config)
        check_config(config)
        self.config = config
        # Registration order follows transformers' encoder, so state_dict() lists names in the same order.
        self.merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.rotary_pos_emb = AxialRotary(self.head_dim, float((config.rope_parameters or {}).get("rope_theta", 1e4)))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle=False)
        self.deepstack_visual_indexes = tuple(config.deepstack_visual_indexes)
        # block index -> DeepStack merger index (features come out in block order, as in transformers)
        self.deepstack_after = {layer: i for i, layer in enumerate(self.deepstack_visual_indexes)}
        check_attention_request(attention)
        self._attention_request = attention
        self._attention_graph_safe = False  # automatic choice only among graph-safe kernels (set by a graph manager)
        self._attention: tuple[KernelSpec, VarlenAttention] | None = None
        # DeepStack mergers on a second stream (CUDA and ROCm), overlapping the blocks after them; see merge_stream.
        self.overlap_deepstack = True
        self.register_load_state_dict_post_hook(rotary_after_load)

    @classmethod
    def from_preset(cls, name: str, attention: str | VarlenAttention | None = None,
                    **overrides) -> Qwen3OmniVisionTower:
        """A randomly initialised tower of preset ``name`` (see ``PRESETS``); ``overrides`` are config fields."""
        return cls(preset_config(name, **overrides), attention=attention)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None,
                        attention: str | VarlenAttention | None = None) -> Qwen3OmniVisionTower:
        """The tower with the weights of a local checkpoint folder (see ``loading.from_pretrained``)."""
        from hwgraph.models.qwen3_omni.loading import from_pretrained

        return from_pretrained(path, dtype=dtype, device=device, attention=attention, tower_cls=cls)

    # ------------------------------------------------------------------ sizes
    @property
    def spatial_merge_size(self) -> int:
        return self.config.spatial_merge_size

    @property
    def patch_row_width(self) -> int:
        """Width of one pixel row: in_channels * temporal_patch_size * patch_size**2."""
        c = self.config
        return c.in_channels * c.temporal_patch_size * c.patch_size**2

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def out_hidden_size(self) -> int:
        return self.config.out_hidden_size

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_visual_indexes)

    @property
    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.num_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def weights_key(self) -> tuple[int, int, int, int]:
        """Where the tower's weights and buffers live, as a key that changes when any of them moves. Moving the tower
        to another dtype or device (``to``, ``half``, ...) allocates new weights; so does giving one block a new
        parameter (``block.mlp.linear_fc1.weight = nn.Parameter(w)``) or loading a state dict with ``assign=True``.
        A graph captured before would read the old, freed memory. ``EncoderGraphManager`` compares the key before every
        call, so it is cheap: three pointer reads (the first and the last weight, the rotary frequencies every
        forward reads) and a layout number, which counts changes of the addresses of all the tower's parameters and
        buffers, listed again only when a module of the process was given a parameter or buffer since the last
        call. A new tensor set as a parameter's ``.data``, or a weight's storage resized in place, is seen here only for
        the first or last weight; ``weights_moved()`` sees it for any."""
        # a copy of a tower (deepcopy, pickle) keeps the count in its __dict__, but has no list of its own yet
        if self.__dict__.get("_layout_registrations") != _Registrations.count or self not in LAYOUT_TENSORS:
            tensors = (*self.parameters(), *self.buffers())
            LAYOUT_TENSORS[self] = tensors
            self._note_layout(tuple(t.data_ptr() for t in tensors))
            self.__dict__["_layout_registrations"] = _Registrations.count
        return (self.patch_embed.proj.weight.data_ptr(), self.merger.mlp[-1].weight.data_ptr(),
                self.rotary_pos_emb.inv_freq.data_ptr(), self.__dict__["_layout_version"])

    def weights_moved(self) -> bool:
        """Whether any weight or buffer lives elsewhere than ``weights_key()`` last saw: every one's address read again
        (about 40 us for 27 blocks on a slow host), which catches what the key's three reads miss, a middle weight
        given new ``.data`` or its storage resized in place. A move changes ``weights_key()`` from then on. The
        manager asks after launching a replay, whose device work hides the cost, and refuses its result."""
        self.weights_key()  # a parameter or buffer registered since: the list of tensors made again
        return self._note_layout(tuple(t.data_ptr() for t in LAYOUT_TENSORS[self]))

    def _note_layout(self, layout: tuple) -> bool:
        """Keep ``layout`` (every weight's and buffer's address); True, and a new layout number, where it moved."""
        if layout == self.__dict__.get("_layout"):
            return False
        self.__dict__["_layout_version"] = self.__dict__.get("_layout_version", -1) + 1
        self.__dict__["_layout"] = layout
        return True

    # ------------------------------------------------------------------ attention
    def set_attention(self, name: str | VarlenAttention | None = None, platform: PlatformInfo | None = None,
                      graph_safe: bool | None = None):
        """Choose the attention kernel now; returns the registry's ``SelectedKernel`` (or a spec for a callable).

        ``name``: a kernel name (honoured or ``SelectionError`` with the reasons), ``"auto"``, a callable, or None
        to keep the current request: the constructor's, or the last one given here (a manager built with
        ``attention=...`` passes it here, so a later manager given None keeps it). Automatic choice uses the
        tower's dtype and head dim, on ``platform`` (default: the platform serving the tower's device), among the
        graph-safe kernels only once ``graph_safe=True`` was given (a graph manager gives it; None keeps the last
        setting). An explicit name is honoured either way. A request that raises changes nothing: the tower keeps
        its previous request and kernel.
        """
        return self.apply_attention_choice(self.attention_choice(name, platform, graph_safe))

    def apply_attention_choice(self, choice):
        """Make ``choice``, what ``attention_choice`` returned, the tower's request and kernel; returns its
        ``SelectedKernel``. A graph manager chooses once, for its device and dtype, before it moves the tower there,
        and applies that choice after the move, instead of asking the registry a second time."""
        request, safe_only, selected = choice
        self._attention_request, self._attention_graph_safe = request, safe_only
        self._attention = (selected.spec, selected.fn)
        log.debug("tower attention %s (%s)", selected.spec.name, selected.reason)
        return selected

    def attention_choice(self, name: str | VarlenAttention | None = None, platform: PlatformInfo | None = None,
                         graph_safe: bool | None = None, dtype: torch.dtype | None = None):
        """What ``set_attention(name, platform, graph_safe)`` would choose for this tower in ``dtype`` (default: its
        own), changing nothing: ``(request, graph_safe, SelectedKernel)``; raises as it would. A graph manager asks
        before it moves a tower to its device and dtype, so that a kernel refused there leaves the tower as it was."""
        from hwgraph.attention.registry import SelectedKernel, choose_attention

        check_attention_request(name)
        request = self._attention_request if name is None else name
        safe_only = self._attention_graph_safe if graph_safe is None else graph_safe
        if callable(request):
            return request, safe_only, SelectedKernel(callable_spec(request), request, "callable given to the tower")
        selected = choose_attention(None if request in (None, AUTO) else request,
                                    platform or platform_for(self.device), dtype=dtype or self.dtype,
                                    head_dim=self.head_dim, graph_safe=safe_only)
        return request, safe_only, selected

    def _chosen_attention(self) -> tuple[KernelSpec, VarlenAttention]:
        """(spec, callable) of the kernel the forward runs, chosen now if not yet (or again after ``to()``)."""
        if self._attention is None:
            self.set_attention()
        return self._attention

    @property
    def attention_spec(self) -> KernelSpec:
        return self._chosen_attention()[0]

    @property
    def attention_kernel(self) -> str:
        """Name of the attention kernel the forward uses (chosen now if not yet)."""
        return self.attention_spec.name

    @property
    def attention_fn(self):
        """The callable the forward runs as attention (chosen now if not yet)."""
        return self._chosen_attention()[1]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if not callable(self._attention_request):
            self._attention = None  # the device or dtype may have changed: choose again at next use
        return self

    def __getstate__(self):
        # The chosen kernel is left out (chosen again at next use from the request, as after ``to()``): its spec holds
        # a gate lambda, so a tower that had run once could not be pickled (torch.save(tower), a process pool).
        state = super().__getstate__()
        state["_attention"] = None
        return state

    # ------------------------------------------------------------------ forward
    # Host work in numpy: a graph break under torch.compile (dynamo tracing it failed with "Expected np.nditer base"
    # for a grid not yet in the metadata cache, so compiling the whole tower crashed on its first new grid).
    @torch.compiler.disable
    def prepare_metadata(self, grid_thw, pixel_values: torch.Tensor | None = None) -> VisionMetadata:
        """Host metadata for images of ``grid_thw`` (list of (t, h, w), or an int array/tensor on the host). With
        ``pixel_values``, they are checked against the grids first, as ``check_pixels`` checks them against metadata:
        rows that do not match are refused before the metadata's tables, which grow with the grids, are built."""
        grid = normalize_grid(grid_thw, self.spatial_merge_size)
        if pixel_values is not None:
            self.check_pixel_rows(pixel_values, grid, sum(t * h * w for t, h, w in grid))
        return grid_metadata(grid, self.spatial_merge_size, self.num_grid_per_side)

    def check_pixels(self, pixel_values: torch.Tensor, metadata: VisionMetadata) -> None:
        """``ValueError`` unless ``pixel_values`` is a ``[metadata.num_rows, patch_row_width]`` floating-point tensor
        (shapes and type only) and ``metadata`` was built for this tower's merge size and position table (another
        tower's gave wrong embeddings, silently)."""
        if not isinstance(metadata, VisionMetadata):  # e.g. a grid: AttributeError "'list' ... no attribute 'grid_thw'"
            raise ValueError(f"metadata must be a VisionMetadata (this tower's prepare_metadata(grid_thw)), got "
                             f"{type(metadata).__name__}: for a grid, call forward(pixel_values, grid_thw)")
        if metadata.device.type == "meta":  # torch said only "Cannot copy out of meta tensor; no data!"
            raise ValueError(f"metadata is on the meta device (no data): build it with this tower's "
                             f"prepare_metadata(grid_thw), on the host, for grids {list(metadata.grid_thw)}")
        # padded metadata's rows are more than its grids need: the message names both
        self.check_pixel_rows(pixel_values, metadata.grid_thw, metadata.num_rows, patches=metadata.num_patches)
        built_for = (metadata.spatial_merge_size, metadata.num_grid_per_side)
        if built_for != (self.spatial_merge_size, self.num_grid_per_side):
            raise ValueError(f"metadata was built for spatial_merge_size {built_for[0]} and a position table of side "
                             f"{built_for[1]}, but this tower has spatial_merge_size {self.spatial_merge_size} and "
                             f"side {self.num_grid_per_side}: build it with this tower's prepare_metadata(grid_thw)")

    def check_pixel_tensor(self, pixel_values) -> None:
        """``ValueError`` unless ``pixel_values`` is a floating-point tensor (its type and dtype only)."""
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be a floating-point torch.Tensor [patches, {self.patch_row_width}], "
                             f"got {type(pixel_values).__name__}"
                             + (f" of {pixel_values.dtype}" if isinstance(pixel_values, torch.Tensor) else ""))

    def check_pixel_rows(self, pixel_values: torch.Tensor, grid, rows: int, patches: int | None = None) -> None:
        """``ValueError`` unless ``pixel_values`` is a dense ``[rows, patch_row_width]`` floating-point tensor with
        data, ``rows`` being what ``grid`` (normalised (t, h, w) triples, named in the message) needs, or, when
        ``patches`` (the grid's own patch rows) is fewer, what metadata padded to ``rows`` needs."""
        self.check_pixel_tensor(pixel_values)
        if pixel_values.is_meta:  # shapes without data: the copy into a graph's buffer (or the eager call) fails
            raise ValueError(f"pixel_values is on the meta device (shape {tuple(pixel_values.shape)}, no data): pass "
                             f"pixel rows with values, on the host or the tower's device")
        if pixel_values.layout != torch.strided:  # a graph's static buffer cannot take a sparse copy: replay failed
            raise ValueError(f"pixel_values must be a dense (strided) tensor, got layout {pixel_values.layout}: pass "
                             f"pixel_values.to_dense()")
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_row_width:
            c = self.config
            raise ValueError(f"pixel_values must be [patches, {self.patch_row_width}] (row width = in_channels "
                             f"{c.in_channels} * temporal_patch_size {c.temporal_patch_size} * patch_size "
                             f"{c.patch_size}**2), got shape {tuple(pixel_values.shape)}")
        if pixel_values.shape[0] != rows:
            if patches is not None and patches != rows:  # it said the grids need the padded count
                raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but the metadata of grids "
                                 f"{list(grid)} ({patches} patch rows) is padded to {rows} rows: pass {rows} rows, "
                                 f"the images' own followed by padding")
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grids {list(grid)} "
                             f"need {rows} patch rows")

    def forward_with_metadata(self, pixel_values: torch.Tensor, metadata: VisionMetadata,
                              block_forward=None) -> VisionOutput:
        """Device work only. ``pixel_values`` ``[R, patch_row_width]`` in merge order; returns ``[R / merge**2,
        out_hidden]`` rows (padding rows included, with unspecified values, when the metadata is padded). Host
        metadata is copied to the pixels' device first (asynchronously); for graph capture pass metadata already on
        the device. ``block_forward``: what runs each block, called as ``VisionBlock.forward_fused`` is (the
        default), e.g. that function compiled once and shared by every block (``EncoderGraphManager(compile=True)``).
        """
        self.check_pixels(pixel_values, metadata)
        if self.patch_embed.proj.weight.is_meta:  # torch's error ("Tensor on device meta is not on the expected
            # device cpu!") named neither the weights nor how to load them; one read a call, the check on failure
            check_materialised(self)
        spec, kernel = self._chosen_attention()
        # A kernel taking host boundaries (NPU) gets them from host metadata, instead of a read in every block.
        boundaries = (host_cu_seqlens(metadata.cu_seqlens.tolist())
                      if spec.reads_host_boundaries and metadata.cu_seqlens.device.type == "cpu"
                      else contextlib.nullcontext())
        run_block = self.block_forward() if block_forward is None else block_forward
        metadata = metadata.to(pixel_values.device)
        # Padding rows never mix into real ones (attention keeps sequences apart, every other step works per row or
        # per aligned merge group), so the kernel may leave them unspecified and skip zeroing them in every block.
        attend = getattr(kernel, "padding_unspecified", kernel)
        x = add_position_embedding(self.patch_embed(pixel_values), self.pos_embed.weight, metadata.pos_indices,
                                   metadata.pos_weights)
        cos, sin = self.rotary_pos_emb(metadata.rotary_positions)
        deepstack = []
        side = self.merge_stream(x.device, x.shape[0])
        merged_from = []  # the DeepStack mergers' inputs stay referenced until the side stream is joined
        blocks = list(self.blocks)
        normed = blocks[0].norm1(x) if blocks else None
        with boundaries:
            for layer, block in enumerate(blocks):
                next_norm = blocks[layer + 1].norm1 if layer + 1 < len(blocks) else None
                x, normed = run_block(block, x, normed, next_norm, cos, sin, metadata.cu_seqlens,
                                      metadata.max_seqlen, attend)
                merger = self.deepstack_after.get(layer)
                if merger is None:
                    continue
                if side is None:
                    deepstack.append(self.merger_list[merger](x))
                    continue
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    deepstack.append(self.merger_list[merger](x))
                merged_from.append(x)
        embeds = self.merger(x)
        if side is not None:
            main = torch.cuda.current_stream(x.device)
            main.wait_stream(side)
            for t in deepstack:  # allocated on the side stream, used on this one from now on
                t.record_stream(main)
        return VisionOutput(embeds, tuple(deepstack))

    def merge_stream(self, device: torch.device, rows: int) -> torch.cuda.Stream | None:
        """The stream the DeepStack mergers run on for ``rows`` patch rows, or None to run them in line.

        A small image leaves most of the GPU idle in every block, and a merger (LayerNorm, two GEMMs of 4608 wide,
        GELU) does not feed the blocks after it, so on CUDA and ROCm it runs on a second stream that forks from the
        current one after its block and joins before the output; a CUDA or HIP graph captures the fork and the join
        as parallel branches. Same kernels, same results. On the H200 (``benchmarks/replay_gaps.py --overlap``,
        TRITON_ATTN, interleaved) one 49-token image replayed 2.6-2.9% faster (the budget-64 graph: 256 rows); 98 tokens
        gained 0-0.7% (budget 128: 512 rows), and from budget 256 (1024 rows) the GEMMs fill the GPU and overlap cost
        0.4-0.5% (session 6); with session 28's kernels, 1.7-1.8% at 1024 rows and 0.2% at 4096
        (``benchmarks/replay_toggle.py merger-overlap``). So mergers overlap up to ``OVERLAP_MAX_ROWS`` rows
        (padding rows counted); in line above that, on other devices, while torch.compile traces, and with
        ``overlap_deepstack = False``. Every tower a thread runs on a device uses that thread's stream there
        (``MERGE_STREAMS``): another thread's capture never takes in this thread's mergers."""
        if not self.overlap_deepstack or rows > OVERLAP_MAX_ROWS or device.type != "cuda" \
                or torch.compiler.is_compiling():
            return None
        return thread_merge_stream(device)

    @staticmethod
    def block_forward():
        """The function ``forward_with_metadata`` runs for each block by default (``VisionBlock.forward_fused``),
        for callers that wrap it, e.g. compile it once for all blocks."""
        return VisionBlock.forward_fused

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> VisionOutput:
        """Eager forward: ``prepare_metadata(grid_thw, pixel_values)`` then ``forward_with_metadata``."""
        return self.forward_with_metadata(pixel_values, self.prepare_metadata(grid_thw, pixel_values))
