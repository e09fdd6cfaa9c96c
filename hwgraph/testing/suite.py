"""The conformance suite a graph backend must pass: ``from hwgraph.testing.suite import *`` in a test module.

Each class checks one behaviour of ``EncoderGraphManager`` on the backend under test, for every attention kernel that
backend's platform offers (see ``hwgraph.testing.cases``: unavailable backends and kernels are skipped with the
reasons their gates give, except a backend refusing a machine of the kind it serves, and a kernel named in
``HWGRAPH_ATTENTION`` refusing the backend's devices, whose checks all err). A backend distribution declares itself and
may override a check by subclassing (``budgets`` and ``max_images`` too: a check whose case the budgets cannot form,
such as a padded image where each budget is one token above the one below, is skipped saying so)::

    from hwgraph.testing.suite import *  # noqa: F401,F403

    HWGRAPH_BACKEND = "rocm"

    class TestPoolRelease(TestPoolRelease):  # the same name replaces the shipped class in this module
        pool_release_slack_bytes = 4 << 20

Every check compares the manager's answer with the tower's eager answer for the same group: float32 within
``torch.testing``'s defaults; bfloat16/float16 within torch.testing's rtol with atol widened to 2e-2/2e-3 (a padded
replay and an unpadded eager call run different GEMM tilings, so near-zero outputs differ by a few ulps of rounding)
and a relative L2 error bound (a stale or misplaced row gives errors of order 1). Override ``tolerances`` and
``relative_l2``. Eager runs the case's attention kernel too, so ``TestAttentionMatchesReference`` compares the kernel
itself with the float64 reference (``hwgraph.testing.reference``): a wrong kernel is wrong in eager and replay alike.
A kernel that is not graph-safe (the manager runs it only eagerly) is checked there alone.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from hwgraph.graphs.base import HostSyncError
from hwgraph.manager import EncoderGraphManager
from hwgraph.testing.cases import UnservedCase, conformance_params, settings_for
from hwgraph.testing.towers import eager_per_image, grid_of, image_tokens, pixels_for, suite_tower

__all__ = ["ConformanceSuite", "TestAttentionMatchesReference", "TestBudgetChanges", "TestCapture", "TestDeclaration",
           "TestDeepStack", "TestEagerFallback", "TestMultiImageGroups", "TestNoHostSync", "TestPoolRelease",
           "TestReplayEqualsEager", "TestRetainedOutputs"]


def weights_fingerprint(tower) -> dict[str, torch.Tensor]:
    """Per parameter and buffer of the tower (non-persistent ones too, such as rotary ``inv_freq``), a checksum of
    its bits that depends on their positions, so that a permutation (a weight transposed in place) changes it:
    the int64 sum of each element's bits times a weight of its index (computed on its device, one host read)."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    tensors = {**dict(tower.named_parameters()), **dict(tower.named_buffers())}

    def checksum(t: torch.Tensor) -> torch.Tensor:
        bits = t.detach().reshape(-1).view(ints[t.element_size()]).to(torch.int64)
        return (bits * (torch.arange(bits.numel(), device=bits.device) % 65521 + 1)).sum()

    sums = torch.stack([checksum(t) for t in tensors.values()])
    return dict(zip(tensors, sums.cpu(), strict=True))


class ConformanceSuite:
    """Fixtures and comparisons shared by every check; parametrised over ``case`` at collection."""

    budgets: tuple[int, ...] = (16, 32, 64)
    #: Images one graph takes; the checks use at most the smallest budget of them (``images_per_graph``).
    max_images: int = 4
    #: dtype -> dict(rtol=..., atol=...) for assert_close; absent: torch.testing's defaults for the dtype.
    # bf16 bounds from the 27-block real preset on the H200: a padded replay against an unpadded eager call showed a
    # relative L2 error of 1.3e-2 and a largest difference of 0.0112 (different GEMM tilings round differently, and
    # 27 blocks accumulate it); a stale, shifted or leaked row gives errors of order 1.
    tolerances: dict = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2}, torch.float16: {"rtol": 1e-3, "atol": 2e-3}}
    #: dtype -> bound on ||got - want|| / ||want|| per tensor; absent: no extra bound.
    relative_l2: dict = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
    #: The checks capture graphs with the case's kernel: a kernel that is not graph-safe has no runnable case.
    captures_graphs: bool = True

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            params = conformance_params(settings_for(metafunc.cls, metafunc.module),
                                        graph_safe_only=metafunc.cls.captures_graphs)
            metafunc.parametrize("case", params)

    @pytest.fixture(autouse=True)
    def backend_serves_this_machine(self, case):
        if isinstance(case, UnservedCase):
            pytest.fail(case.reason, pytrace=False)

    @pytest.fixture
    def tower(self, case):
        return suite_tower(case.preset, case.device, case.dtype)

    @pytest.fixture
    def manager(self, tower, case):
        weights = weights_fingerprint(tower)
        m = self.captured(self.make_manager(tower, case))
        yield m
        m.close()
        changed = [name for name, sums in weights_fingerprint(tower).items() if not torch.equal(sums, weights[name])]
        assert not changed, (f"capture or replay on the {m.backend.name} graph backend changed the tower's weights in "
                             f"place ({len(changed)} tensors, e.g. {changed[:3]}): eager answers change with them, so "
                             f"no comparison with eager can show it")

    @staticmethod
    def captured(manager: EncoderGraphManager) -> EncoderGraphManager:
        """``manager`` after ``capture()``; a failed budget fails the check here, naming why, since every check would
        otherwise report a symptom of running eagerly (no graph memory, no replays)."""
        manager.capture()
        failures = manager.stats()["capture_failures"]
        if failures:
            manager.close()
            pytest.fail(f"the {manager.backend.name} graph backend failed to capture budgets {sorted(failures)}, so "
                        f"the manager runs them eagerly: {failures}", pytrace=False)
        return manager

    def make_manager(self, tower, case) -> EncoderGraphManager:
        return EncoderGraphManager(tower, device=case.device, dtype=case.dtype, budgets=list(self.budgets),
                                   max_images_per_graph=self.images_per_graph, graph_backend=case.backend,
                                   graph_mode=case.mode, attention=case.kernel)

    # ---------------------------------------------------------------- helpers
    @property
    def images_per_graph(self) -> int:
        """``max_images``, but at most the smallest budget: every image has at least one token, so a graph of budget
        ``b`` holds at most ``b`` images and the manager refuses more (a vendor's budgets of (1, 2, 3) with the
        default ``max_images`` of 4 erred in every check at setup)."""
        return min(self.max_images, min(self.budgets))

    def padded_tokens(self, budget: int) -> int | None:
        """Tokens of one image that ``budget`` holds with padding, yet more than the budget below it holds (a quarter
        short of it, at least one), or None where there is no such count: the budget is one token above the budget
        below it (budgets of (1, 2, 3)), or is 1."""
        tokens = max(budget - max(1, budget // 4), self.budget_below(budget) + 1)
        return tokens if tokens < budget else None

    def budget_for(self, tokens: int) -> int | None:
        """The budget the single-replay policy must pick for a group of ``tokens``, or None (eager)."""
        return min((b for b in self.budgets if b >= tokens), default=None)

    def budget_below(self, budget: int) -> int:
        """The largest budget below ``budget`` (0 for the smallest): a group of more tokens needs ``budget``."""
        return max((b for b in self.budgets if b < budget), default=0)

    @staticmethod
    def uneven(sizes: tuple[int, ...], total: int) -> tuple[int, ...]:
        """``sizes`` (merged tokens per image, uneven so that a reordering shows) as they are when they sum to at
        most ``total``, else scaled down to fit it, each at least 1 (a vendor's small budgets: a group too large for
        every budget crashed its check, and an image of 0 tokens was refused)."""
        if sum(sizes) <= total:
            return sizes
        fitted = [max(1, n * total // sum(sizes)) for n in sizes]
        while sum(fitted) > total and max(fitted) > 1:
            fitted[fitted.index(max(fitted))] -= 1
        if sum(fitted) > total:
            raise ValueError(f"{len(sizes)} images of at least 1 token cannot share {total} tokens: each of the "
                             f"suite's budgets must be at least its max_images")
        return tuple(fitted)

    def grid(self, tower, *tokens: int, frames: int = 1) -> list[tuple[int, int, int]]:
        """One single-frame image per entry of ``tokens`` (merged tokens each)."""
        return [grid_of(n, tower.spatial_merge_size, frames) for n in tokens]

    def assert_close(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        tol = self.tolerances.get(want.dtype, {})
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")
        bound = self.relative_l2.get(want.dtype)
        if bound is not None:
            error = float(torch.linalg.vector_norm(got.float() - want.float())
                          / torch.linalg.vector_norm(want.float()).clamp_min(1e-30))
            assert error <= bound, f"{what}: relative L2 error {error:.3g} above {bound} for {want.dtype}"

    def assert_matches_eager(self, got, tower, pixels, grid, what: str = "") -> None:
        """Per image: the embeddings and every DeepStack feature equal the eager answer for the group."""
        want = eager_per_image(tower, pixels, grid)
        assert len(got) == len(want), f"{what}: {len(got)} outputs for {len(want)} images"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            label = f"{what} image {i} of grid {grid}"
            assert g.embeds.shape == w.embeds.shape, f"{label}: embeds {tuple(g.embeds.shape)}, " \
                                                     f"expected {tuple(w.embeds.shape)} (padding leaked?)"
            self.assert_close(g.embeds, w.embeds, f"{label} embeddings")
            assert len(g.deepstack) == len(w.deepstack), f"{label}: {len(g.deepstack)} DeepStack features, " \
                                                         f"expected {len(w.deepstack)}"
            for j, (gd, wd) in enumerate(zip(g.deepstack, w.deepstack, strict=True)):
                self.assert_close(gd, wd, f"{label} DeepStack feature {j}")

    def encode_and_check(self, manager, tower, grid, seed: int, what: str = ""):
        pixels = pixels_for(tower, grid, seed)
        out = manager.encode(pixels, grid)
        self.assert_matches_eager(out, tower, pixels, grid, what)
        return out


class TestDeclaration(ConformanceSuite):
    def test_the_probe_and_the_backend_class_agree_on_name_and_modes(self, case):
        """``hwgraph info`` and option checks read the probe's ``BackendSpec``; the manager constructs its class.
        A mode the probe lists that the class lacks would pass every check and then fail at construction."""
        from hwgraph.registry import spec_named

        spec = spec_named(case.backend)
        cls = spec.load()
        assert (cls.name, tuple(cls.modes)) == (spec.name, tuple(spec.modes)), (
            f"the probe of {spec.name!r} declares modes {list(spec.modes)}, while its class {spec.class_path} is "
            f"named {cls.name!r} with modes {list(cls.modes)}")


class TestCapture(ConformanceSuite):
    def test_every_budget_captures_and_reports_its_memory(self, manager):
        stats = manager.stats()
        assert stats["capture_failures"] == {}, f"captures failed: {stats['capture_failures']}"
        assert sorted(manager.graphs) == sorted(self.budgets)
        assert sorted(stats["capture_bytes_per_budget"]) == sorted(self.budgets)
        # A budget's bytes count its static input buffers too, made before the capture: what memory_in_use() grew by
        # while capturing is the rest (a backend whose memory_in_use() fell passed while the buffers outweighed it).
        grown = {b: n - manager.graphs[b].input_bytes() for b, n in stats["capture_bytes_per_budget"].items()}
        negative = {b: n for b, n in grown.items() if n < 0}
        assert not negative, f"memory_in_use() fell while capturing these budgets (bytes): {negative}"

    def test_graphs_record_the_numerics_settings_they_keep(self, manager):
        """``numerics_settings(dtype)``: ``(name, value)`` pairs, hashable, the same on every read while nothing
        changes them, and what each graph was captured under (the manager replays a graph only under them)."""
        now = manager.backend.numerics_settings(manager.dtype)
        malformed = [p for p in now if not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str))]
        assert isinstance(now, tuple) and not malformed, \
            f"numerics_settings() must return a tuple of (name, value) pairs, got {now!r}"
        hash(now)  # compared before every replay
        assert manager.backend.numerics_settings(manager.dtype) == now, "numerics_settings() changed between reads"
        kept = {b: entry.numerics for b, entry in manager.graphs.items() if entry.numerics != now}
        assert not kept, f"graphs recorded other settings than the backend's now ({now!r}): {kept}"


class TestReplayEqualsEager(ConformanceSuite):
    @pytest.mark.parametrize("fill", ["full", "padded"])
    def test_single_image_replays_at_each_budget_and_equals_eager(self, manager, tower, fill):
        # padded, yet more than the budget below holds (budgets of (16, 24, 32): 24 tokens replayed budget 24)
        sizes = {b: b if fill == "full" else self.padded_tokens(b) for b in sorted(self.budgets)}
        sizes = {b: tokens for b, tokens in sizes.items() if tokens is not None}
        if not sizes:  # budgets of (1, 2, 3): the check found each "padded" image filling its budget
            pytest.skip(f"no budget of {tuple(self.budgets)} holds a padded image: each is 1 or one token above the "
                        f"budget below it, which holds any image of fewer tokens")
        for i, (budget, tokens) in enumerate(sizes.items()):
            grid = self.grid(tower, tokens)
            before = dict(manager.stats()["replays_per_budget"])
            self.encode_and_check(manager, tower, grid, seed=100 + i, what=f"budget {budget} ({fill})")
            after = manager.stats()["replays_per_budget"]
            assert after.get(budget, 0) == before.get(budget, 0) + 1, \
                f"a {tokens}-token image must replay budget {budget}; replays per budget {after}"


    def test_replays_overwrite_the_output_tensors_capture_returned(self, manager, tower):
        """``CapturedGraph.outputs`` are static: each replay writes its results into the tensors the capture returned
        (vLLM's integration keeps them as its output buffers and reads them after every replay)."""
        budget = min(self.budgets)
        kept = {slots: graph.outputs for slots, graph in manager.graphs[budget].graphs.items()}
        for i, tokens in enumerate((budget, max(1, budget - 3))):  # a vendor's smallest budget may be 3 or less
            out = self.encode_and_check(manager, tower, self.grid(tower, tokens), seed=150 + i, what=f"call {i + 1}")
            slots, _ = manager.graphs[budget].graph_for(1)
            torch.testing.assert_close(
                kept[slots][0, :tokens], out[0].embeds, rtol=0, atol=0,
                msg=lambda m, i=i: f"call {i + 1}: the output tensors budget {budget}'s capture returned do not hold "
                                   f"the replay's results (did replay() write new tensors instead?): {m}")


class TestMultiImageGroups(ConformanceSuite):
    def test_several_images_share_one_replay_in_caller_order(self, manager, tower):
        if self.images_per_graph < 2:  # the check's group was one image, checking no sharing and no order
            pytest.skip(f"a graph takes one image here (max_images={self.max_images}, smallest budget "
                        f"{min(self.budgets)}): no group of several images replays")
        tokens = self.uneven((4, 1, 16, 2)[: self.images_per_graph], max(self.budgets))  # a reordering shows
        grid = self.grid(tower, *tokens)
        out = self.encode_and_check(manager, tower, grid, seed=200, what=f"group of {len(grid)}")
        assert [o.embeds.shape[0] for o in out] == list(image_tokens(grid, tower.spatial_merge_size))
        stats = manager.stats()
        assert stats["replays"] == 1 and stats["hits"] == len(grid) and stats["misses"] == 0
        assert stats["padding_tokens"] == self.budget_for(sum(tokens)) - sum(tokens)

    def test_the_largest_budget_holds_a_full_group(self, manager, tower):
        budget, n = max(self.budgets), self.images_per_graph
        # the budget's every token (budgets of (2, 3) with two images a graph: 3 // 2 tokens each replayed budget 2)
        grid = self.grid(tower, *(budget // n + (i < budget % n) for i in range(n)))
        self.encode_and_check(manager, tower, grid, seed=201, what="full group")
        assert manager.stats()["replays_per_budget"] == {budget: 1}

    def test_each_slot_count_graph_of_a_budget_replays_its_own_groups(self, tower, case):
        """A budget captured once per sequence-slot count, the graphs sharing its static buffers (what a slot-bound
        kernel gets by default), asked for explicitly so that it runs with every kernel: a backend whose graphs of
        one pool all replayed the first passed every other check where the kernel is not slot-bound (TORCH_SDPA)."""
        most = self.images_per_graph
        budget, counts = min(self.budgets), sorted({c for c in (1, 2, most) if c <= most})
        m = self.captured(EncoderGraphManager(
            tower, device=case.device, dtype=case.dtype, budgets=[budget], max_images_per_graph=most,
            slot_counts=counts, graph_backend=case.backend, graph_mode=case.mode, attention=case.kernel))
        try:
            calls = [counts[-1], *counts, *reversed(counts)]  # each count after each other one
            for i, n in enumerate(calls):
                tokens = self.uneven(tuple(max(1, budget // (2 * n)) + j % 2 for j in range(n)), budget)
                self.encode_and_check(m, tower, self.grid(tower, *tokens), seed=210 + i,
                                      what=f"call {i + 1}: {n} image(s), slot-count graphs {counts}")
            # a group of n images replays the graph with n slots: each count is one the calls use
            assert m.stats()["replays_per_slots"] == {c: calls.count(c) for c in counts}
        finally:
            m.close()


class TestAttentionMatchesReference(ConformanceSuite):
    #: Lengths of the packed batch's sequences: several, so that a kernel attending across them shows; most short, so
    #: that each output row is a mean of few value rows, far from zero; one longer than a kernel's tile of 256 rows
    #: (eager and replay run the same tiles: a kernel stopping after its first key or query block failed no check).
    attention_seqlens: tuple[int, ...] = (7, 1, 300, 23, 12)
    #: The scale the kernel is given, in units of the usual 1/sqrt(head_dim): not 1, so that a kernel ignoring its
    #: ``scale`` for that default (what the tower passes, so no other check shows it) fails.
    attention_scale_factor: float = 2.0
    captures_graphs = False  # a kernel that is not graph-safe runs in eager calls (attention="NPU"): checked too

    def test_the_kernel_equals_the_float64_reference(self, case):
        """Every other check compares the manager with the tower's eager answer, which runs the same kernel: one
        returning zeros, or letting the images of a group attend to each other, passed them all. Here the kernel
        (and its ``padding_unspecified`` variant, which the tower runs) meets the float64 reference on a batch in the
        preset's heads and head dim, with empty sequence slots and garbage padding rows as a graph's buffers hold, and
        q, k, v strided views as the tower passes them (a kernel reading them as contiguous passed every check)."""
        from hwgraph.attention.base import host_cu_seqlens
        from hwgraph.attention.registry import kernel_named
        from hwgraph.models.qwen3_omni import preset_config
        from hwgraph.testing.reference import as_the_tower_passes, assert_matches_reference, random_packed_batch

        spec = kernel_named(case.kernel)
        kernel = spec.load()
        config = preset_config(case.preset)
        head_dim = config.hidden_size // config.num_heads
        batch = random_packed_batch(self.attention_seqlens, config.num_heads, head_dim, zero_length=2, padding_rows=9,
                                    dtype=case.dtype, device=case.device, seed=900,
                                    scale=self.attention_scale_factor * head_dim ** -0.5)
        batch = as_the_tower_passes(batch)
        variants = {kernel.__name__: kernel}
        if hasattr(kernel, "padding_unspecified"):
            variants["padding_unspecified"] = kernel.padding_unspecified
        for name, fn in variants.items():
            bounds = host_cu_seqlens(batch.cu_seqlens.tolist()) if spec.reads_host_boundaries else \
                contextlib.nullcontext()
            with torch.inference_mode(), bounds:
                out = fn(*batch.args())
            if fn is not kernel:
                out = out.clone()  # outside inference mode: a tensor that may be written
                out[batch.total:] = 0  # its padding rows are unspecified
            try:
                assert_matches_reference(out, batch)
            except AssertionError as exc:
                raise AssertionError(f"attention kernel {case.kernel} ({name}) on sequences {batch.seqlens}, "
                                     f"{batch.zero_length} empty slots and {batch.padding_rows} padding rows, scale "
                                     f"{batch.scale:.4g}, differs "
                                     f"from the float64 reference: {exc}") from None


class TestEagerFallback(ConformanceSuite):
    @pytest.mark.parametrize("kind", ["over budget", "video", "too many images"])
    def test_a_group_no_graph_holds_runs_once_eagerly_and_is_counted(self, manager, tower, kind):
        if kind == "over budget":
            grid = self.grid(tower, max(self.budgets) + 4)
        elif kind == "video":
            grid = self.grid(tower, 4, frames=2)
        else:
            grid = self.grid(tower, *([1] * (self.images_per_graph + 1)))
        self.encode_and_check(manager, tower, grid, seed=300, what=f"eager fallback ({kind})")
        stats = manager.stats()
        assert stats["replays"] == 0 and stats["hits"] == 0
        assert stats["eager_groups"] == 1 and stats["misses"] == len(grid)
        assert stats["eager_reasons"] == {kind: 1}


class TestBudgetChanges(ConformanceSuite):
    def test_consecutive_calls_switch_budgets_without_stale_inputs(self, manager, tower):
        small, middle, large = sorted(self.budgets)[0], sorted(self.budgets)[len(self.budgets) // 2], max(self.budgets)

        def fitted(tokens: tuple[int, ...]) -> tuple[int, ...]:
            # groups a graph takes (max_images = 1: the two-image groups ran eagerly, failing a correct backend), of
            # at least one token an image (budgets of 3 or less: small // 2 and large - 3 were 0 or below)
            return self.uneven(tuple(max(1, n) for n in tokens[: self.images_per_graph]), large)

        calls = [*map(fitted, [(large,), (small // 2,), (middle // 2, middle // 2), (small,), (large - 3,), (2, 1)]),
                 (large + 1,), fitted((small // 2,))]
        for i, tokens in enumerate(calls):
            self.encode_and_check(manager, tower, self.grid(tower, *tokens), seed=400 + i, what=f"call {i + 1}")
        want: dict = {}
        for tokens in calls:
            budget = self.budget_for(sum(tokens))
            if budget is not None:
                want[budget] = want.get(budget, 0) + 1
        stats = manager.stats()
        assert stats["replays_per_budget"] == want
        assert stats["eager_groups"] == len(calls) - sum(want.values()) == 1

    def test_the_same_budget_with_new_pixels_gives_new_answers(self, manager, tower):
        # padded in the smallest budget (a fixed 12 tokens fit no budget of (4, 8): three eager calls, checking none)
        budget = min(self.budgets)
        grid = self.grid(tower, max(1, budget * 3 // 4))
        for seed in (410, 411, 412):
            self.encode_and_check(manager, tower, grid, seed=seed, what=f"seed {seed}")
        assert manager.stats()["replays_per_budget"] == {budget: 3}, f"each call must replay budget {budget}"

    def test_a_non_finite_request_leaves_later_requests_in_its_graph_unharmed(self, manager, tower):
        """Rows past a smaller call keep the larger call's pixels in the graph's buffer: the attention kernel must
        never multiply them into real rows (a masked key's weight is 0, and 0 times NaN is NaN)."""
        # the largest budget holding a later, smaller request (in the same graph, so more than the budget below)
        fits = {b: max(b // 2, self.budget_below(b) + 1) for b in sorted(self.budgets, reverse=True)}
        fits = {b: tokens for b, tokens in fits.items() if tokens < b}
        if not fits:  # budgets of (1, 2, 3): the later request filled the graph, leaving no NaN row to read
            pytest.skip(f"no budget of {tuple(self.budgets)} holds a request smaller than another in its graph: each "
                        f"is 1 or one token above the budget below it")
        large, tokens = next(iter(fits.items()))
        grid = self.grid(tower, large)
        pixels = pixels_for(tower, grid, 420)
        pixels[-min(4, large - tokens) * tower.spatial_merge_size**2:] = float("nan")  # the last tokens' patches
        manager.encode(pixels, grid)
        out = self.encode_and_check(manager, tower, self.grid(tower, tokens), seed=421,
                                    what="the call after a NaN request")
        assert all(bool(torch.isfinite(o.embeds).all()) for o in out)
        assert manager.stats()["replays_per_budget"] == {large: 2}, f"both calls must replay budget {large}'s graph"


class TestDeepStack(ConformanceSuite):
    def test_every_deepstack_slice_of_every_image_equals_eager(self, manager, tower):
        # as many images and tokens as a graph takes: with max_images = 2 the group of three ran eagerly, checking no
        # replay, as did its 16 tokens with budgets of (4, 8)
        grid = self.grid(tower, *self.uneven((6, 9, 1)[: self.images_per_graph], max(self.budgets)))
        out = self.encode_and_check(manager, tower, grid, seed=500, what="DeepStack group")
        assert manager.stats()["replays"] == 1, f"the DeepStack group {grid} must replay: {manager.stats()}"
        for o, n in zip(out, image_tokens(grid, tower.spatial_merge_size), strict=True):
            assert len(o.deepstack) == tower.num_deepstack > 0
            assert all(d.shape == (n, tower.out_hidden_size) for d in o.deepstack)
            assert o.embeds.shape == (n, tower.out_hidden_size)


class TestRetainedOutputs(ConformanceSuite):
    def test_outputs_kept_from_one_call_are_unchanged_by_later_calls(self, manager, tower):
        # sized by the budgets: a fixed 16 tokens fit no budget of (4, 8), and every call ran eagerly, checking none
        large, small = max(self.budgets), min(self.budgets)
        grid = self.grid(tower, large)
        first = self.encode_and_check(manager, tower, grid, seed=600, what="call 1")
        kept = [o.clone() for o in first]
        self.encode_and_check(manager, tower, grid, seed=601, what="call 2 (same budget)")
        self.encode_and_check(manager, tower, self.grid(tower, small), seed=602, what="call 3 (smallest budget)")
        want = dict(collections.Counter((large, large, small)))  # one budget: all three calls replay it
        assert manager.stats()["replays_per_budget"] == want, "every call must replay"
        for i, (o, k) in enumerate(zip(first, kept, strict=True)):
            torch.testing.assert_close(o.embeds, k.embeds, rtol=0, atol=0,
                                       msg=lambda m, i=i: f"image {i} of call 1 changed after later calls: {m}")
            for d, kd in zip(o.deepstack, k.deepstack, strict=True):
                torch.testing.assert_close(d, kd, rtol=0, atol=0,
                                           msg=lambda m, i=i: f"DeepStack of call 1 image {i} changed: {m}")


class TestNoHostSync(ConformanceSuite):
    def test_sync_guard_rejects_a_host_read(self, manager):
        t = torch.ones(2, device=manager.device)
        reads = {".item()": lambda: t.sum().item(), ".tolist()": lambda: t.tolist(), ".cpu()": lambda: t.cpu(),
                 '.to("cpu")': lambda: t.to("cpu"), '.to("cpu", copy=True)': lambda: t.to("cpu", copy=True),
                 "bool()": lambda: bool(t.sum()), "int()": lambda: int(t.sum()), "float()": lambda: float(t.sum()),
                 "operator.index() (range(t))": lambda: range(t.sum().long())}
        let_through = []
        for what, read in reads.items():
            try:
                with manager.backend.sync_guard():
                    read()
            except HostSyncError:
                continue
            let_through.append(what)
        assert not let_through, f"sync_guard() let {', '.join(let_through)} read device memory back to the host"
        for what, read in reads.items():
            try:
                read()
            except HostSyncError as exc:
                pytest.fail(f"{what} still raises after the sync_guard() block ended: {exc}", pytrace=False)

    def test_replay_and_fallback_read_nothing_back_from_the_device(self, manager, tower):
        # as many images and tokens as a graph takes (max_images = 1, or budgets of (4, 8): the group ran eagerly, and
        # the hits check failed)
        grid = self.grid(tower, *self.uneven((8, 4)[: self.images_per_graph], max(self.budgets)))
        video = self.grid(tower, 4, frames=2)
        pixels, video_pixels = pixels_for(tower, grid, 700), pixels_for(tower, video, 701)
        with manager.backend.sync_guard():
            out = manager.encode(pixels, grid)
            fallback = manager.encode(video_pixels, video)
        manager.backend.synchronize()
        self.assert_matches_eager(out, tower, pixels, grid, "replay under sync_guard")
        self.assert_matches_eager(fallback, tower, video_pixels, video, "fallback under sync_guard")
        stats = manager.stats()
        assert stats["hits"] == len(grid) and stats["replays"] == 1 and stats["misses"] == 1


class TestPoolRelease(ConformanceSuite):
    #: Bytes ``memory_in_use()`` may stay above its pre-capture value after ``close()`` (allocator rounding).
    pool_release_slack_bytes: int = 0

    def test_close_returns_the_graph_memory(self, tower, case):
        # A first capture on the device makes the shared capture stream and its math-library workspaces, which
        # outlive every manager (freeing them could break other live graphs): measure from after one.
        self.captured(self.make_manager(tower, case)).close()
        m = self.make_manager(tower, case)
        try:  # a failure before its close() would leave its graphs held for the rest of the run
            m.backend.synchronize()
            before = m.backend.memory_in_use()
            self.captured(m)
            held = m.backend.memory_in_use()
            assert held > before, f"capture held no memory: memory_in_use {before} -> {held} bytes"
            # a replay (8 tokens fit no budget of (1, 2, 3): the call ran eagerly)
            self.encode_and_check(m, tower, self.grid(tower, min(8, max(self.budgets))), seed=800,
                                  what="before close")
        finally:
            m.close()
        after = m.backend.memory_in_use()
        assert after <= before + self.pool_release_slack_bytes, \
            f"close() left {after - before} bytes of {held - before} held (memory_in_use {before} -> {held} -> {after})"
        with pytest.raises(RuntimeError, match="after close"):
            m.encode(pixels_for(tower, self.grid(tower, 4), 801), self.grid(tower, 4))
