"""The single-replay encoder graph manager for vLLM (see ``hwgraph.integrations.vllm``, which re-exports it).

A step replays only when one captured graph holds all its images (count and tokens); otherwise the whole group
runs as one eager call. Graphs are captured through hwgraph's backend registry, so CUDA, ROCm and NPU share it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hwgraph.integrations.vllm_version import VLLM_VERSION  # noqa: F401  (the version gate, before vLLM's internals)

# isort: split
from vllm.v1.worker.encoder_cudagraph import BudgetGraphMetadata, EncoderCudaGraphManager
from vllm.v1.worker.encoder_cudagraph_defs import EncoderItemSpec

from hwgraph.budgets import NUMERICS_CHANGED, settings_changes, single_replay_budget
from hwgraph.platform import platform_for
from hwgraph.registry import create_backend

log = logging.getLogger("hwgraph.integrations.vllm")


@dataclass(frozen=True)
class ReplayDecision:
    """What one step's group of images does: replay ``budget``'s graph, or (``budget is None``) one eager call."""

    budget: int | None
    # "replay", "empty", "video", "too many images", "over budget", "no graphs", "capture failed", or
    # NUMERICS_CHANGED ("numerics settings changed since capture")
    reason: str

    @property
    def replay(self) -> bool:
        return self.budget is not None


class SingleReplayEncoderCudaGraphManager(EncoderCudaGraphManager):
    """vLLM's encoder graph manager with hwgraph's dispatch and capture primitive.

    Upstream packs a step's items greedily into several budget graphs. Here a step replays only when one captured
    graph holds all its images (count <= ``max_batch_size``, tokens <= the budget; the smallest such budget);
    otherwise the whole group runs as one eager call, since several replays plus their copies were not measured
    to beat a single eager forward. Video (t > 1) goes eager. Graphs come from ``hwgraph.registry.create_backend``
    (``graph_backend``: a backend name, default ``$HWGRAPH_GRAPH_BACKEND`` or the best for ``device``;
    ``graph_mode``: one of its modes, default its first). vLLM constructs the manager with neither, so a deployment
    that wants others installs a subclass that passes them (``install_single_replay_manager``). Budgets,
    buffer copies (``_run_budget_graph``), DP sharding and hit/miss counting (images) are upstream's.

    For a model with an hwgraph tower (``model.tower``, e.g. ``Qwen3OmniEncoderCudaGraphAdapter``), as
    ``hwgraph.EncoderGraphManager`` does: the tower's automatic kernel choice takes graph-safe kernels only (an
    explicit kernel is kept); nothing is captured when the tower's attention kernel is not graph-safe
    (``capture_refusal``; every group runs eagerly: through this manager's eager path under vLLM's v1 runner, which
    calls ``execute`` regardless, and as the model's own ``embed_multimodal`` under its gpu/ runner, which asks
    ``is_captured()`` first and so leaves those groups out of the stats), and a replay after the tower's weights moved
    since capture (``tower.to``, another dtype or device) raises ``RuntimeError`` instead of reading freed memory, as
    does one after the tower's attention kernel changed (``tower.set_attention``).
    """

    def __init__(self, vllm_config, device: torch.device, dtype: torch.dtype, model, graph_backend: str | None = None,
                 graph_mode: str | None = None):
        super().__init__(vllm_config, device, dtype, model)
        if set(self.config.paths) != {"default"} or self._capture_axes:
            raise ValueError(f"{type(self).__name__} serves single-path encoders without capture axes; this model "
                             f"has paths {sorted(self.config.paths)} and capture_axes {self._capture_axes}: use "
                             f"vLLM's EncoderCudaGraphManager for it")
        device = torch.device(device)
        self.backend = create_backend(graph_backend, device=device, mode=graph_mode, platform=platform_for(device))
        self.capture_failures: dict[int, str] = {}  # budget -> why the last capture() left it eager
        # (weights_key, dtype, device, attention_fn, attention_kernel) of the tower at capture
        self._captured_tower: tuple | None = None
        self._captured_numerics: tuple | None = None  # the backend's numerics_settings() at capture
        self._numerics_warned = False
        tower = self._tower()
        if tower is not None:  # as EncoderGraphManager: automatic choice among graph-safe kernels (on NPU, SDPA)
            tower.set_attention(platform=platform_for(device), graph_safe=True)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the dispatch counters (upstream's hits and misses included); captured graphs stay."""
        self.graph_hits = 0
        self.graph_misses = 0
        self.replays = 0
        self.eager_groups = 0
        self.eager_reasons: dict[str, int] = {}
        self.padding_tokens = 0  # budget tokens replayed that held no image
        self.replays_per_budget: dict[int, int] = {}

    # ------------------------------------------------------------------ capture
    def capture(self, graph_pool: Any = None):
        """Capture every budget, largest first (upstream's loop) into ``graph_pool``: vLLM passes its platform's
        graph pool handle, which is what hwgraph's device backends use; the CPU reference backend, or no pool,
        gets a pool of the backend's own. Failures (``capture_failures``) are this capture's only, and so are the
        graphs: those of an earlier capture are released first (``clear()``), so that a budget this capture failed
        or refused is not replayed from a graph of other weights, numerics or kernel."""
        self.clear()
        refusal = self.capture_refusal()
        if refusal:
            self.capture_failures = {b: refusal for b in self.path_token_budgets["default"] if b > 0}
            log.warning("no encoder graphs captured on %s, every group runs eagerly: %s", self.backend.name, refusal)
            return
        tower = self._tower()
        if tower is not None and hasattr(tower, "weights_moved"):
            tower.weights_moved()  # a move since the key was last read (a weight given new .data) counted first
        # The graphs read the weights where they live now; replay checks that they did not move (_check_tower).
        self._captured_tower = None if tower is None else (tower.weights_key(), tower.dtype, tower.device,
                                                           tower.attention_fn, tower.attention_kernel)
        # ... and keep the numerics settings of now (decide() replays only under them)
        self._captured_numerics, self._numerics_warned = self._numerics(), False
        if graph_pool is None or not self.backend.accelerates:
            graph_pool = self.backend.new_pool()
        super().capture(graph_pool)
        level = logging.WARNING if self.capture_failures and not self.captured_budgets() else logging.INFO
        log.log(level, "encoder graphs captured on %s: budgets %s; failed: %s", self.backend.name,
                self.captured_budgets(), self.capture_failures or "none")

    def _capture_budget_graph(self, token_budget: int, path: str = "default", axis_keys: tuple = ()):
        if token_budget in self._get_graph_set(path) or token_budget in self.capture_failures:
            # vLLM keeps a budget its config lists twice ([64, 64, 128]) and its loop visits each entry; capture() began
            # with clear(), so this capture already tried it: a second graph replaced the first unreleased, and a
            # second attempt that failed reported a budget failed whose first graph replayed
            return
        model = self.model
        try:  # the buffers too: allocating them on the device may fail (out of memory) as the capture may
            values = model.prepare_encoder_cudagraph_capture_inputs(
                token_budget, self.max_batch_size, self.max_frames_per_batch, self.device, self.dtype, path,
                axis_keys,
            ).values

            def forward() -> torch.Tensor:
                return model.encoder_cudagraph_forward({**values}, path=path)  # a copy: forwards may pop keys

            with torch.inference_mode():
                graph = self.backend.capture(forward, self.graph_pool)
        except Exception as exc:  # a failed capture leaves that budget eager: a slower answer, never a wrong one
            self.capture_failures[token_budget] = f"{type(exc).__name__}: {exc}"
            log.warning("encoder graph capture of budget %d failed on %s, it stays eager: %s", token_budget,
                        self.backend.name, self.capture_failures[token_budget])
            self.backend.synchronize()
            return
        self._get_graph_set(path)[token_budget] = BudgetGraphMetadata(
            token_budget=token_budget, max_batch_size=self.max_batch_size,
            max_frames_per_batch=self.max_frames_per_batch, graph=graph, input_buffers=values,
            output_buffer=graph.outputs, axis_keys=(),
        )

    def clear(self) -> None:
        for graph_set in self.budget_graphs.values():
            for meta in graph_set.values():
                meta.graph.release()
        super().clear()
        self.capture_failures = {}
        self._captured_tower = self._captured_numerics = None

    def _tower(self):
        """The model's hwgraph tower, or None for a model of vLLM's own (the tower guards then do not apply)."""
        tower = getattr(self.model, "tower", None)
        return tower if hasattr(tower, "weights_key") else None

    def _numerics(self) -> tuple:
        """The backend's numerics settings for the dtype the graphs compute in: the tower's where there is one (vLLM
        gives the manager its model's dtype, which the tower need not share), as it was at capture once captured. Read
        for the tower's dtype of now, a tower moved to another dtype since (CUDA's settings differ per dtype) looked
        like changed settings: its groups ran eagerly, logged as such, instead of ``_check_tower`` naming the move."""
        if self._captured_tower is not None:
            return self.backend.numerics_settings(self._captured_tower[1])
        tower = self._tower()
        return self.backend.numerics_settings(self.dtype if tower is None else tower.dtype)

    def capture_refusal(self) -> str | None:
        """Why nothing may be captured for this model, or None."""
        tower = self._tower()
        if tower is not None and not tower.attention_spec.graph_safe:
            return f"attention kernel {tower.attention_kernel} is not graph-safe"
        return None

    def _check_tower(self) -> None:
        """``RuntimeError`` when the tower's weights were moved (``to``, ``half``, another manager's dtype or device)
        since capture, where the graphs would read freed memory, or its attention kernel changed since. Host reads only
        (``tower.weights_key()``, ``tower.attention_fn``), no device sync."""
        tower = self._tower()
        if tower is None or self._captured_tower is None:
            return
        key, dtype, device, kernel, kernel_name = self._captured_tower
        if tower.weights_key() != key:
            raise RuntimeError(
                f"replay: the tower's weights were moved since its encoder graphs were captured for {dtype} on "
                f"{device} (the tower is now {tower.dtype} on {tower.device}; tower.to() or a manager with another "
                f"dtype or device moves it, and so does a weight given a new tensor or new .data, or its storage "
                f"resized), so the graphs would read freed memory. clear() this manager and "
                f"capture() again on the tower as it is now")
        if tower.attention_fn is not kernel:
            # as EncoderGraphManager: the graphs would go on running the captured kernel while eager groups ran the
            # tower's new one (and the CPU backend's replays, which run the forward again, the new one too)
            raise RuntimeError(
                f"replay: the tower's attention kernel is now {tower.attention_kernel}, not the one its encoder graphs "
                f"were captured with ({kernel_name}): tower.set_attention() or another manager on the same tower "
                f"chose another kernel. clear() this manager and capture() again with the tower's kernel of now")

    def captured_budgets(self) -> list[int]:
        return sorted(b for b in self._get_graph_set("default") if isinstance(b, int) and b > 0)

    # ------------------------------------------------------------------ dispatch
    def decide(self, item_specs: list[EncoderItemSpec], modality: str = "image",
               frames: list[int] | None = None) -> ReplayDecision:
        """The single-replay rule for one group (host values only); eager too while the backend's numerics settings
        differ from those of the capture (``GraphBackend.numerics_settings``: e.g. CUDA's TF32 setting changed
        since), which the graphs keep, until ``clear()`` and ``capture()``."""
        if not item_specs:
            return ReplayDecision(None, "empty")
        tokens = sum(spec.output_tokens for spec in item_specs)
        budget, reason = single_replay_budget(
            self.captured_budgets(), len(item_specs), tokens, self.max_batch_size,
            video=modality != "image" or bool(frames and max(frames) > 1), failed=self.capture_failures)
        if budget is not None and self._captured_numerics is not None:
            numerics = self._numerics()
            if numerics != self._captured_numerics:
                if not self._numerics_warned:
                    self._numerics_warned = True
                    log.warning("encoder graphs were captured under other numerics settings than now (%s): groups "
                                "run eagerly until clear() and capture()",
                                settings_changes(self._captured_numerics, numerics))
                return ReplayDecision(None, NUMERICS_CHANGED)
        return ReplayDecision(budget, reason)

    def _run_budget_graph(self, mm_kwargs: dict[str, Any], token_budget: int, path: str = "default",
                          axis_keys: tuple = ()) -> torch.Tensor | None:
        self._check_tower()  # every replay, from either dispatch (this one or upstream's packing)
        output = super()._run_budget_graph(mm_kwargs, token_budget, path, axis_keys)
        moved = getattr(self._tower(), "weights_moved", None)
        if moved is not None:
            # every weight looked at while the device runs the replay: a middle weight given new .data or a resized
            # storage, which weights_key's reads miss, was read at its old, freed address; the key compared whatever
            # this look found, as another manager's look on the same tower may have found the move first
            moved()
            self._check_tower()
        return output

    def execute(self, mm_kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        # None: vLLM's runners then call the model's embed_multimodal (gpu_model_runner, v2 encoder_runner), e.g. for
        # a group of precomputed image_embeds, which has nothing to encode.
        accepts = getattr(self.model, "encoder_cudagraph_accepts", None)
        if accepts is not None and not accepts(mm_kwargs):
            return None
        return super().execute(mm_kwargs)

    def _execute_local(self, mm_kwargs: dict[str, Any]) -> list[torch.Tensor]:
        # Called by upstream's execute() for the whole step, or for this rank's share under DP.
        with torch.inference_mode():
            specs = self._get_item_specs(mm_kwargs)
            if not specs:
                return []
            frames_of = getattr(self.model, "get_encoder_cudagraph_item_frames", None)
            decision = self.decide(specs, self.model.get_input_modality(mm_kwargs),
                                   frames_of(mm_kwargs) if frames_of else None)
            tokens = [spec.output_tokens for spec in specs]
            indices = list(range(len(specs)))
            if decision.replay:
                output = self._run_budget_graph(mm_kwargs, decision.budget)  # counts the hits
                self.replays += 1
                self.padding_tokens += decision.budget - sum(tokens)
                self.replays_per_budget[decision.budget] = self.replays_per_budget.get(decision.budget, 0) + 1
            else:
                output = self.model.encoder_eager_forward(mm_kwargs)
                self.graph_misses += len(specs)
                self.eager_groups += 1
                if decision.reason not in self.eager_reasons:
                    # vLLM logs only its hit rate, at debug level: without this a step that never replays says nothing
                    log.info("encoder group of %d image(s), %d tokens, ran eagerly: %s (captured budgets %s, at most "
                             "%d images per replay); later ones are counted in get_cumulative_stats()"
                             "['eager_reasons']", len(specs), sum(tokens), decision.reason, self.captured_budgets(),
                             self.max_batch_size)
                self.eager_reasons[decision.reason] = self.eager_reasons.get(decision.reason, 0) + 1
            # vLLM's _dp_gather pads and all-gathers in self.dtype (a rank without images sends that): every rank
            # must send the same dtype, whatever the tower's. Cast what postprocess hands back, not ``output``: for a
            # group of image_embeds (a model that does not forward encoder_cudagraph_accepts) it returns the
            # embeddings themselves, which went out in their own dtype.
            cast = self.use_dp and output.dtype != self.dtype
            dest: dict[int, torch.Tensor] = {}
            # Replayed rows live in the graph's output buffer, which the next replay overwrites: clone them (a cast
            # copies them anyway).
            self.model.postprocess_encoder_output({"default": output}, indices, tokens, dest,
                                                  clone=decision.replay and not cast, batch_mm_kwargs=mm_kwargs)
            features = [dest[i] for i in indices]
            return [t.to(self.dtype) for t in features] if self.use_dp else features

    def get_cumulative_stats(self) -> dict[str, Any]:
        stats = super().get_cumulative_stats()
        stats.update(replays=self.replays, eager_groups=self.eager_groups, eager_reasons=dict(self.eager_reasons),
                     padding_tokens=self.padding_tokens, replays_per_budget=dict(self.replays_per_budget),
                     captured_budgets=self.captured_budgets(), capture_failures=dict(self.capture_failures),
                     graph_backend=self.backend.name, graph_mode=self.backend.mode)
        return stats


# ---------------------------------------------------------------------------------------------------- wiring
# Modules of vLLM 0.33 that construct EncoderCudaGraphManager: gpu_model_runner imports it from the defining module
# when it builds one, the v2 model state binds it at import.
_CONSTRUCTING_MODULES = ("vllm.v1.worker.encoder_cudagraph", "vllm.v1.worker.gpu.model_states.interface")


def install_single_replay_manager(manager_cls: type = SingleReplayEncoderCudaGraphManager) -> Callable[[], None]:
    """Opt in: make vLLM's model runners in this process build ``manager_cls`` instead of upstream's manager.

    Call it before the engine creates its workers (in the worker process, e.g. from a vLLM plugin). Returns a
    function that restores upstream's class. Nothing is changed unless this is called. ``TypeError`` unless
    ``manager_cls`` subclasses upstream's manager; ``RuntimeError`` when an install is already in place (undo it
    first: a second one would be ignored by modules the first rewired, and undoing either would undo both). The undo
    acts once, and not at all after a later install: it cannot remove another install's class.
    """
    original = EncoderCudaGraphManager  # upstream's class, as imported above
    if not (isinstance(manager_cls, type) and issubclass(manager_cls, original)):
        raise TypeError(f"install_single_replay_manager needs a subclass of vLLM's EncoderCudaGraphManager, got "
                        f"{manager_cls!r}")
    for name in _CONSTRUCTING_MODULES:
        held = getattr(sys.modules.get(name), "EncoderCudaGraphManager", original)
        if held is not original:
            raise RuntimeError(f"{name}.EncoderCudaGraphManager is already {held.__module__}.{held.__qualname__}: "
                               f"call the undo that install_single_replay_manager returned before installing "
                               f"{manager_cls.__qualname__}")
    swap(original, manager_cls)
    token = object()
    _INSTALLED[:] = [token]

    def undo() -> None:
        """Restore upstream's class, once, and only while this install is the live one: an undo kept from an earlier
        install does nothing to a later one."""
        if _INSTALLED != [token]:
            return
        _INSTALLED.clear()
        # Also the modules imported since: the v2 model state binds whatever the defining module held then.
        swap(manager_cls, original)

    return undo


_INSTALLED: list[object] = []  # the token of the live install_single_replay_manager, if any


def swap(current: type, replacement: type) -> None:
    """In every imported module of ``_CONSTRUCTING_MODULES`` that holds ``current``, put ``replacement``."""
    for name in _CONSTRUCTING_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "EncoderCudaGraphManager", None) is current:
            module.EncoderCudaGraphManager = replacement
