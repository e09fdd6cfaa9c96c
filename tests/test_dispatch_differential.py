"""Randomized differential test of the manager's dispatch on the CPU reference backend: seeded groups of images, sized
around every budget's boundaries, against the tiny tower's eager forward of each image alone, with the stats and the
static buffers' metadata refills predicted call by call from the rules the README states."""

from __future__ import annotations

import math
import random
import threading
from collections import OrderedDict

import pytest
import torch

from hwgraph import budgets as budget_rules
from hwgraph import manager as manager_module
from hwgraph.attention.sdpa import sdpa_varlen
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.models.qwen3_omni.metadata import VisionMetadata, normalize_grid

SEED = 20260607
MERGE = 2  # the tiny preset's spatial merge size


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    assert tower.spatial_merge_size == MERGE
    return tower


def slot_bound_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
    """TORCH_SDPA declared slot-bound, so that each budget is captured once per slot count on the CPU."""
    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


slot_bound_sdpa.slot_bound = True


def tokens_of(grid) -> list[int]:
    return [t * h * w // MERGE**2 for t, h, w in grid]


def image_grid(rng: random.Random, tokens: int, frames: int = 1) -> tuple[int, int, int]:
    """A random (frames, h, w) patch grid of ``tokens`` merged tokens per frame: any factorisation, either way round."""
    a = rng.choice([d for d in range(1, tokens + 1) if tokens % d == 0])
    return (frames, a * MERGE, tokens // a * MERGE)


def split_tokens(rng: random.Random, total: int, images: int) -> list[int]:
    """``total`` tokens as ``images`` positive parts, in random proportions."""
    cuts = sorted(rng.sample(range(1, total), images - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def single_replay_rule(captured, failed, images: int, tokens: int, max_images: int, video: bool):
    """The README's dispatch rule, written out plainly: ``(budget, "replay")`` or ``(None, why eager)``."""
    if video:
        return None, "video"
    if images > max_images:
        return None, "too many images"
    for budget in sorted(captured):
        if budget >= tokens:
            return budget, "replay"
    if any(budget >= tokens for budget in failed):
        return None, "capture failed"
    return None, "over budget" if captured else "no graphs"


class Dispatch:
    """What the manager must do with each group (``single_replay_rule``; a group that would replay runs eagerly while
    the numerics settings differ from the capture's, and replays in the graph with the fewest sequence slots that
    hold its images), the stats those choices add up to, and the metadata work its replays cost: a copy into a
    budget's static buffers only when they hold another grid (``refills``), and padded host metadata built only for
    a (grid, budget) pair that is not among the ``PADDED_CACHE_SIZE`` most recently copied (``paddings``)."""

    def __init__(self, m: EncoderGraphManager, failed=()):
        self.m, self.failed = m, set(failed)
        self.hits = self.misses = self.replays = self.eager_groups = self.padding = self.calls = 0
        self.reasons, self.per_budget, self.per_slots = {}, {}, {}
        self.all_refills = self.all_paddings = 0  # over every capture
        self.captured()

    def captured(self) -> None:
        """After capture(): the budgets held, the grid each one's buffers were left holding by the capture's own
        check, and the padded metadata it cached; the metadata work is counted afresh from here."""
        assert sorted(self.m.graphs) == sorted(set(self.m.budgets) - self.failed)
        self.holds = {b: entry.filled_grid for b, entry in self.m.graphs.items()}
        self.recent = OrderedDict.fromkeys(self.m._padded)  # (grid, budget) pairs, least recently copied first
        self.refills = self.paddings = 0
        self.numerics_changed = False

    def expect(self, grid) -> tuple[int | None, int | None, str]:
        video = any(t > 1 for t, _, _ in grid)
        budget, why = single_replay_rule(self.m.graphs, self.failed, len(grid), sum(tokens_of(grid)),
                                         self.m.max_images, video)
        if budget is None:
            return None, None, why
        if self.numerics_changed:
            return None, None, budget_rules.NUMERICS_CHANGED
        return budget, next(n for n in self.m.slot_counts if n >= len(grid)), why

    def record(self, grid, budget, slots, why) -> None:
        self.calls += 1
        if budget is None:
            self.misses += len(grid)
            self.eager_groups += 1
            self.reasons[why] = self.reasons.get(why, 0) + 1
            return
        self.hits += len(grid)
        self.replays += 1
        self.padding += budget - sum(tokens_of(grid))
        self.per_budget[budget] = self.per_budget.get(budget, 0) + 1
        self.per_slots[slots] = self.per_slots.get(slots, 0) + 1
        grid = tuple(grid)
        if self.holds[budget] == grid:
            return
        self.refills += 1
        self.all_refills += 1
        self.holds[budget] = grid
        if (grid, budget) in self.recent:
            self.recent.move_to_end((grid, budget))
            return
        self.paddings += 1
        self.all_paddings += 1
        self.recent[grid, budget] = None
        while len(self.recent) > manager_module.PADDED_CACHE_SIZE:
            self.recent.popitem(last=False)

    def check_stats(self, where: str) -> None:
        s = self.m.stats()
        got = {k: s[k] for k in ("hits", "misses", "replays", "eager_groups", "eager_reasons", "padding_tokens",
                                 "replays_per_budget", "replays_per_slots", "calls", "images")}
        want = dict(hits=self.hits, misses=self.misses, replays=self.replays, eager_groups=self.eager_groups,
                    eager_reasons=self.reasons, padding_tokens=self.padding, replays_per_budget=self.per_budget,
                    replays_per_slots=self.per_slots, calls=self.calls, images=self.hits + self.misses)
        assert got == want, where


class Groups:
    """Seeded groups of images around the budgets' edges: exactly a budget's tokens, one over, one under, random
    sizes, one image more than the graphs' slots, videos, and groups seen before (again, alternating with another,
    reordered, or with one image turned round: the same tokens in other metadata)."""

    def __init__(self, rng: random.Random, budgets: list[int], max_images: int):
        self.rng, self.budgets, self.max_images = rng, budgets, max_images
        self.sent: list[tuple] = []

    def fresh(self, total: int) -> list[tuple[int, int, int]]:
        rng = self.rng
        count = rng.randint(1, min(self.max_images + 1, total))
        return [image_grid(rng, n) for n in split_tokens(rng, total, count)]

    def boundary_cases(self) -> list[list[tuple[int, int, int]]]:
        """Every budget filled exactly (by one squarest image, the capture's own grid, and by several), one token
        over and one under, and one-token images one more than the slots (fitting by tokens, not by slots)."""
        cases = []
        for b in self.budgets:
            cases.append([budget_rules.filling_grid(b, MERGE)])
            cases.append(self.fresh(b))
            cases.append(self.fresh(b + 1))
            if b > 1:
                cases.append(self.fresh(b - 1))
        cases.append([(1, MERGE, MERGE)] * (self.max_images + 1))
        cases.append([(1, MERGE, MERGE)] * self.max_images)
        return cases

    def next(self) -> list[tuple[int, int, int]]:
        rng, sent = self.rng, self.sent
        kind = rng.random()
        if sent and kind < 0.15:
            grid = list(rng.choice(sent))  # seen before: the caches' hit
        elif len(sent) >= 2 and kind < 0.3:
            grid = list(sent[-2])  # A, B, A, B: each budget's buffers refilled in turn
        elif sent and kind < 0.4:
            grid = list(rng.choice(sent))
            rng.shuffle(grid)  # the same images in another order
        elif sent and kind < 0.5:
            grid = list(rng.choice(sent))
            i = rng.randrange(len(grid))
            t, h, w = grid[i]
            grid[i] = (t, w, h)  # the same tokens, other positions
        elif kind < 0.58:
            frames = rng.randint(2, 3)
            grid = self.fresh(rng.randint(1, self.budgets[0]))
            i = rng.randrange(len(grid))
            grid[i] = (frames, *grid[i][1:])  # a video among images
        else:
            b = rng.choice(self.budgets)
            total = rng.choice([b, b + 1, max(1, b - 1), rng.randint(1, self.budgets[-1] + 4)])
            grid = self.fresh(total)
        return grid


class Pixels:
    """Seeded pixel rows per (call, image), and each image's eager forward alone: what every replay and eager group
    must give for it, whatever shares its call."""

    def __init__(self, tower):
        self.tower = tower

    def rows(self, call: int, grid) -> list[torch.Tensor]:
        out = []
        for i, (t, h, w) in enumerate(grid):
            gen = torch.Generator().manual_seed(SEED + 1000 * call + i)
            out.append(torch.randn(t * h * w, self.tower.patch_row_width, generator=gen))
        return out

    def alone(self, rows, grid) -> list:
        with torch.inference_mode():
            return [self.tower.forward(r, [g]) for r, g in zip(rows, grid, strict=True)]


def assert_same(got, want, where: str) -> None:
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g.embeds, w.embeds, msg=lambda m, i=i: f"{where}, image {i} embeds: {m}")
        assert len(g.deepstack) == len(w.deepstack) == 3, where
        for j, (gd, wd) in enumerate(zip(g.deepstack, w.deepstack, strict=True)):
            torch.testing.assert_close(gd, wd, msg=lambda m, i=i, j=j: f"{where}, image {i} deepstack {j}: {m}")


def count_metadata_work(monkeypatch) -> dict[str, list]:
    """The grids of every metadata copy into static buffers (``VisionMetadata.copy_from``) and of every padding
    (``VisionMetadata.padded``), from now on."""
    work = {"copy_from": [], "padded": []}
    for name, seen in work.items():
        real = getattr(VisionMetadata, name)

        def counted(self, *args, real=real, seen=seen, **kwargs):
            seen.append(self.grid_thw)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(VisionMetadata, name, counted)
    return work


def check_metadata_work(work: dict[str, list], rules: Dispatch, where: str) -> None:
    assert (len(work["copy_from"]), len(work["padded"])) == (rules.refills, rules.paddings), where
    for seen in work.values():
        seen.clear()


CONFIGS = {
    # odd and prime budgets: their capture grids are thin (7 tokens: 2 x 14 patches) and their padding uneven
    "odd budgets": dict(budgets=[4, 7, 16, 33], max_images=4, attention="TORCH_SDPA", calls=120),
    # one graph per slot count (1, 2, 4, 8): a group replays the fewest slots that hold it
    "slot-bound": dict(budgets=[8, 12, 40], max_images=8, attention=slot_bound_sdpa, calls=110),
    # as many images as the smallest budget's tokens, and explicit slot counts (2 given, 3 added)
    "images = smallest budget": dict(budgets=[3, 6], max_images=3, attention=slot_bound_sdpa, slot_counts=[2],
                                     calls=60),
    # one image per graph; the smallest budget is one token (a single 2 x 2 patch frame)
    "one image": dict(budgets=[1, 2, 5], max_images=1, attention="TORCH_SDPA", calls=50),
    # two captures fail: what the one in the middle would hold replays in the budget above it, what only the
    # largest would hold is a capture failure, not over budget
    "failed budgets": dict(budgets=[4, 10, 20, 30], max_images=2, attention="TORCH_SDPA", fail=(10, 30), calls=70),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_group_equals_each_images_eager_forward_and_the_stats_and_refills_follow_the_rules(
        tower, monkeypatch, name):
    config = dict(CONFIGS[name])
    rng = random.Random(f"{SEED}-{name}")
    fail = config.pop("fail", ())
    if fail:
        real = manager_module.capture_budget

        def capture_budget(tower, backend, pool, budget, **kwargs):
            if budget in fail:
                raise RuntimeError(f"no room for budget {budget}")
            return real(tower, backend, pool, budget, **kwargs)

        monkeypatch.setattr(manager_module, "capture_budget", capture_budget)
    m = EncoderGraphManager(tower, budgets=config["budgets"], max_images_per_graph=config["max_images"],
                            graph_backend="cpu", attention=config["attention"],
                            slot_counts=config.get("slot_counts"))
    m.capture()
    rules = Dispatch(m, failed=fail)
    work = count_metadata_work(monkeypatch)
    groups = Groups(rng, m.budgets, m.max_images)
    pixels = Pixels(tower)
    schedule = groups.boundary_cases() + [None] * config["calls"]
    kept = None  # the previous call's outputs and answers: no later call may change them
    numerics_from, numerics_to = len(schedule) // 2, len(schedule) // 2 + 6
    for call, grid in enumerate(schedule):
        if call == numerics_from:  # the caller changes a setting the graphs keep: replays stop ...
            monkeypatch.setattr(m.backend, "numerics_settings", lambda dtype: (("fake_tf32", True),))
            rules.numerics_changed = True
        if call == numerics_to:  # ... until capture() captures every budget again under the new settings
            check_metadata_work(work, rules, f"{name}: before capturing again")
            m.capture()
            rules.captured()
            work["copy_from"].clear(), work["padded"].clear()
        grid = grid if grid is not None else groups.next()
        groups.sent.append(tuple(grid))
        where = f"{name}: call {call}, grid {grid} ({sum(tokens_of(grid))} tokens)"
        rows = pixels.rows(call, grid)
        budget, slots, why = rules.expect(grid)
        out = m.encode(torch.cat(rows), grid)
        rules.record(grid, budget, slots, why)
        rules.check_stats(where)
        assert [o.embeds.shape[0] for o in out] == tokens_of(grid), where
        assert_same(out, pixels.alone(rows, grid), where)
        if kept is not None:
            assert_same(*kept)
        kept = (out, [o.clone() for o in out], f"{where}, kept to the next call")
    check_metadata_work(work, rules, f"{name}: at the end")
    s = m.stats()
    assert s["replays"] > 0 and s["eager_groups"] > 0
    assert 0 < rules.all_paddings < rules.all_refills  # padded metadata built, and reused
    m.close()


def test_single_replay_budget_follows_the_rule_on_both_sides_of_every_boundary():
    """Every token count up to two past the largest budget, every image count up to one past the slots, images and
    video, failed budgets below, between and above the captured ones; the captured budgets as the manager passes
    them (a dict) and as the vLLM manager does (a sorted list)."""
    rng = random.Random(SEED)
    for _ in range(150):
        configured = rng.sample(range(1, 48), rng.randint(1, 5))
        failed = set(rng.sample(configured, rng.randint(0, len(configured))))
        captured = sorted(set(configured) - failed)
        max_images = rng.randint(1, min(configured))
        for tokens in range(1, max(configured) + 3):
            for images in range(1, min(tokens, max_images + 1) + 1):
                for video in (False, True):
                    want = single_replay_rule(captured, failed, images, tokens, max_images, video)
                    for held in (dict.fromkeys(captured, "graph"), captured):
                        got = budget_rules.single_replay_budget(held, images, tokens, max_images, video,
                                                                failed=sorted(failed))
                        assert got == want, (captured, sorted(failed), images, tokens, max_images, video)


def test_filling_grid_holds_exactly_the_tokens_in_the_squarest_whole_merge_blocks():
    for merge in (1, 2, 3):
        for tokens in range(1, 700):
            t, h, w = budget_rules.filling_grid(tokens, merge)
            assert t == 1 and h % merge == 0 and w % merge == 0 and h <= w, (tokens, merge)
            assert h * w == tokens * merge**2, (tokens, merge)
            side = h // merge  # the largest divisor of tokens up to its square root
            assert all(tokens % d for d in range(side + 1, math.isqrt(tokens) + 1)), (tokens, merge)


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_the_patch_row_limit_takes_the_last_token_that_fits_and_refuses_the_next(merge):
    last = budget_rules.MAX_PATCH_ROWS // merge**2
    assert budget_rules.patch_rows_refusal(last, merge) is None
    assert f"{last + 1} tokens are {(last + 1) * merge**2} patch rows" in budget_rules.patch_rows_refusal(last + 1,
                                                                                                        merge)
    t, h, w = budget_rules.filling_grid(last, merge)
    assert h * w == last * merge**2 <= budget_rules.MAX_PATCH_ROWS
    with pytest.raises(ValueError, match=rf"{last + 1} tokens are {(last + 1) * merge**2} patch rows"):
        budget_rules.filling_grid(last + 1, merge)


def test_a_grid_of_exactly_the_row_limit_is_taken_and_one_row_more_is_refused():
    rows = budget_rules.MAX_PATCH_ROWS
    assert normalize_grid([(1, 1, rows)], 1) == ((1, 1, rows),)
    assert normalize_grid([(1, 1, rows - 5), (1, 1, 5)], 1) == ((1, 1, rows - 5), (1, 1, 5))
    with pytest.raises(ValueError, match=rf"holds {rows + 1} patch rows in all; cu_seqlens are int32"):
        normalize_grid([(1, 1, rows - 4), (1, 1, 5)], 1)


def test_default_budgets_double_up_to_the_cap_and_slot_counts_at_most_double_a_groups_images():
    assert budget_rules.auto_budgets(budget_rules.DEFAULT_CAP) == [64, 128, 256]
    assert budget_rules.auto_budgets(budget_rules.CALIBRATION_CAP) == [64, 128, 256, 512, 1024, 2048]
    for cap in range(budget_rules.MIN_AUTO_BUDGET, 5000, 37):
        budgets = budget_rules.auto_budgets(cap)
        assert budgets[0] == 64 and budgets[-1] <= cap < 2 * budgets[-1], cap
        assert all(b == 2 * a for a, b in zip(budgets[:-1], budgets[1:], strict=True)), cap
    for max_images in range(1, 70):
        counts = budget_rules.default_slot_counts(max_images)
        assert counts == sorted(set(counts)) and counts[-1] == max_images, max_images
        for images in range(1, max_images + 1):
            slots = min(n for n in counts if n >= images)
            assert slots < 2 * images or slots == max_images == images, (max_images, images)


def test_padded_metadata_keeps_the_real_rows_and_first_seqs_any_slot_count_that_holds_the_frames(tower):
    """Random groups (videos among them) padded by random whole merge blocks and sequence slots."""
    rng = random.Random(SEED)
    merge_area = MERGE**2
    for _ in range(60):
        grid = [image_grid(rng, rng.randint(1, 12), frames=rng.choice([1, 1, 1, 2, 3]))
                for _ in range(rng.randint(1, 4))]
        meta = tower.prepare_metadata(grid)
        rows, frames = meta.num_rows, meta.num_frames
        assert rows == sum(t * h * w for t, h, w in grid) and meta.num_tokens == sum(tokens_of(grid))
        num_patches = rows + merge_area * rng.randint(0, 5)
        num_seqs = frames + rng.randint(0, 4)
        padded = meta.padded(num_patches, num_seqs)
        assert (padded.num_rows, padded.num_seqs, padded.max_seqlen) == (num_patches, num_seqs, num_patches)
        assert padded.num_token_rows == num_patches // merge_area and padded.num_tokens == meta.num_tokens
        assert padded.is_padded == (num_patches != rows or num_seqs != frames)
        for name in ("pos_indices", "pos_weights"):
            assert torch.equal(getattr(padded, name)[:, :rows], getattr(meta, name)), name
            assert not getattr(padded, name)[:, rows:].any(), name
        assert torch.equal(padded.rotary_positions[:rows], meta.rotary_positions)
        assert not padded.rotary_positions[rows:].any()
        cu = padded.cu_seqlens.tolist()
        assert cu[: frames + 1] == meta.cu_seqlens.tolist() and cu[frames:] == [rows] * (num_seqs - frames + 1)
        for slots in range(frames, num_seqs + 1):
            view = padded.first_seqs(slots)
            assert view.cu_seqlens.tolist() == cu[: slots + 1] and view.pos_indices is padded.pos_indices
        if frames > 1:
            with pytest.raises(ValueError, match=rf"num_seqs={frames - 1} is fewer than the {frames} frames"):
                padded.first_seqs(frames - 1)
        with pytest.raises(ValueError, match=rf"num_patches={num_patches + 1} is not a multiple of "
                                             rf"spatial_merge_size\*\*2={merge_area}"):
            meta.padded(num_patches + 1, num_seqs)
        if frames > 1:
            with pytest.raises(ValueError, match=rf"{frames} sequences \(frames\) do not fit in num_seqs={frames - 1}"):
                meta.padded(num_patches, frames - 1)


def raised_within(seconds: float, fn, *args, **kwargs):
    """The exception ``fn(*args, **kwargs)`` raised, run in a daemon thread; ``pytest.fail`` when it returned instead,
    or is still running after ``seconds``."""
    outcome = []

    def run():
        try:
            outcome.append(("returned", fn(*args, **kwargs)))
        except Exception as exc:  # handed back to the test
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        pytest.fail(f"{fn.__name__}(*{args}, **{kwargs}) still running after {seconds} s")
    kind, value = outcome[0]
    if kind == "returned":
        pytest.fail(f"{fn.__name__}(*{args}, **{kwargs}) returned {value!r} instead of raising")
    return value


@pytest.mark.parametrize("kwargs, named", [
    (dict(cap=256, start=0), "start must be a positive int, got 0"),  # doubled 0 forever
    (dict(cap=256, start=-64), "start must be a positive int, got -64"),  # doubled away from the cap forever
    (dict(cap=float("inf")), "cap must be a positive int, got inf"),  # doubled forever
    (dict(cap=256, start=1.5), "start must be a positive int, got 1.5"),  # float budgets 1.5, 3.0, ...
    (dict(cap=300.0), "cap must be a positive int, got 300.0"),
])
def test_auto_budgets_refuse_a_cap_or_start_that_is_not_a_positive_int_naming_it(kwargs, named):
    error = raised_within(5, budget_rules.auto_budgets, **kwargs)
    assert isinstance(error, ValueError) and str(error) == f"auto_budgets: {named}", error
    with pytest.raises(ValueError, match=r"budget cap 32 is below the smallest auto budget 64"):
        budget_rules.auto_budgets(32)
