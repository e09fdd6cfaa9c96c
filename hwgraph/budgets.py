"""Token budgets: validation, auto-inference, and the patch grid that fills a budget."""

from __future__ import annotations

import math
import numbers

MIN_AUTO_BUDGET = 64  # merged tokens of the smallest image the Qwen3-Omni processor makes
DEFAULT_CAP = 256
CALIBRATION_CAP = 2048
DEFAULT_MAX_IMAGES = 8


def check_flag(name: str, value, allow_none: bool = False) -> None:
    """``ValueError`` naming ``name`` and ``value`` unless it is a bool (or None, where that means "decide for me"):
    a string such as ``"no"`` would otherwise count as on."""
    if isinstance(value, bool) or (allow_none and value is None):
        return
    expected = "True, False or None" if allow_none else "True or False"
    raise ValueError(f"{name} must be {expected}, got {value!r}")


def is_int(value) -> bool:
    """An integer of any kind (Python's, numpy's), but not a bool, which Python counts as one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_cap(cap) -> int:
    """``cap`` when it is an int of at least the smallest auto budget; ``ValueError`` naming it otherwise."""
    if not is_int(cap) or cap < MIN_AUTO_BUDGET:
        raise ValueError(f"max_budget must be an int >= {MIN_AUTO_BUDGET} (the smallest auto budget), got {cap!r}")
    return int(cap)


def auto_budgets(cap: int = DEFAULT_CAP, start: int = MIN_AUTO_BUDGET) -> list[int]:
    """Budgets doubling from ``start`` up to and including ``cap``: 64, 128, 256. ``ValueError`` naming the value
    unless both are positive ints (a start of 0 or below, or an infinite cap, doubled forever; a float start gave
    float budgets), or when ``cap`` is below ``start``."""
    cap, start = positive_ints("auto_budgets", cap=cap, start=start)
    if cap < start:
        raise ValueError(f"budget cap {cap} is below the smallest auto budget {start}")
    out, b = [], start
    while b <= cap:
        out.append(b)
        b *= 2
    return out


def int_list(name: str, values, what: str) -> list[int]:
    """``values`` (any iterable of integers: a list, a tuple, a range, a numpy array) as a list of ints;
    ``ValueError`` naming ``name``, the value and ``what`` each must be, when it is not one."""
    zero_dim = getattr(values, "ndim", None) == 0  # a numpy or torch scalar: iterable in type, not in fact
    if isinstance(values, (str, bytes, numbers.Number)) or zero_dim or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of ints ({what}), got {values!r}")
    values = list(values)
    bad = [v for v in values if not is_int(v)]
    if bad:
        raise ValueError(f"{name} must be ints ({what}), got {bad}")
    return [int(v) for v in values]


def validate_budgets(budgets, max_images_per_graph: int) -> list[int]:
    """Sorted budgets; ``ValueError`` naming the rule and the values on a violation."""
    values = int_list("budgets", budgets, "merged-token counts")
    if not values:
        raise ValueError("budgets must not be empty")
    nonpositive = [b for b in values if b <= 0]
    if nonpositive:
        raise ValueError(f"budgets must be positive, got {nonpositive}")
    dups = sorted({b for b in values if values.count(b) > 1})
    if dups:
        raise ValueError(f"budgets must not repeat, got duplicates {dups} in {values}")
    values.sort()
    if not is_int(max_images_per_graph) or max_images_per_graph < 1:
        raise ValueError(f"max_images_per_graph must be a positive int, got {max_images_per_graph!r}")
    if max_images_per_graph > values[0]:
        raise ValueError(f"max_images_per_graph ({max_images_per_graph}) must not be above the smallest "
                         f"budget ({values[0]}): every image has at least one token")
    return values


def default_slot_counts(max_images: int) -> list[int]:
    """Sequence-slot counts captured per budget for a slot-bound kernel: powers of two below ``max_images``, and
    ``max_images``; a group then replays with at most twice the slots it fills."""
    out, n = [], 1
    while n < max_images:
        out.append(n)
        n *= 2
    return out + [max_images]


def validate_slot_counts(slot_counts, max_images: int) -> list[int]:
    """Sorted slot counts, ``max_images`` included (a graph must hold every group it accepts); ``ValueError``
    naming the rule and the values on a violation."""
    values = int_list("slot_counts", slot_counts, f"sequence-slot counts in 1..{max_images}")
    bad = [n for n in values if not 1 <= n <= max_images]
    if bad:
        raise ValueError(f"slot_counts must be ints in 1..max_images_per_graph ({max_images}), got {bad}")
    dups = sorted({n for n in values if values.count(n) > 1})
    if dups:
        raise ValueError(f"slot_counts must not repeat, got duplicates {dups} in {values}")
    return sorted(set(values) | {max_images})


MAX_PATCH_ROWS = 2**31 - 1  # patch rows of one call: cu_seqlens are int32, as the varlen kernels take them


def positive_ints(where: str, **values) -> tuple[int, ...]:
    """``values`` as Python ints, in order; ``ValueError`` naming ``where`` and the first that is not a positive int
    of any kind (``is_int``)."""
    for name, value in values.items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return tuple(int(value) for value in values.values())


def patch_rows_refusal(tokens: int, merge: int) -> str | None:
    """Why ``tokens`` merged tokens at merge size ``merge`` are more patch rows than one call takes (``cu_seqlens``
    are int32), or None."""
    rows = tokens * merge * merge
    if rows <= MAX_PATCH_ROWS:
        return None
    return (f"{tokens} tokens are {rows} patch rows at merge size {merge}; a call takes at most {MAX_PATCH_ROWS} "
            f"(int32 cu_seqlens), {MAX_PATCH_ROWS // (merge * merge)} tokens")


def filling_grid(tokens: int, merge: int) -> tuple[int, int, int]:
    """A single-frame patch grid ``(1, h, w)`` with exactly ``tokens`` merged tokens, as square as possible.
    ``ValueError`` unless both are positive ints (0 tokens failed in ``max()``, a merge of 0 gave the grid
    ``(1, 0, 0)``), or when its patch rows overflow int32 ``cu_seqlens`` (the divisor search scanned about
    ``sqrt(tokens)`` numbers first: hours for ``tokens`` of 10**20)."""
    tokens, merge = positive_ints("filling_grid", tokens=tokens, merge=merge)
    refusal = patch_rows_refusal(tokens, merge)
    if refusal:
        raise ValueError(refusal)
    a = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    return (1, a * merge, (tokens // a) * merge)


#: Why a group runs eagerly when the graph that would hold it was captured under other numerics settings than the
#: graph backend's now (``GraphBackend.numerics_settings``): its replay would keep the old ones.
NUMERICS_CHANGED = "numerics settings changed since capture"


def settings_changes(then: tuple, now: tuple) -> str:
    """``name: old -> new`` for each setting of two ``numerics_settings()`` readings that differs."""
    old, new = dict(then), dict(now)
    return ", ".join(f"{name}: {old.get(name)!r} -> {new.get(name)!r}" for name in dict.fromkeys([*old, *new])
                     if old.get(name) != new.get(name))


def single_replay_budget(budgets, images: int, tokens: int, max_images: int, video: bool,
                         failed=()) -> tuple[int | None, str]:
    """The single-replay rule for one group of images: the smallest captured budget holding all ``tokens`` when
    there are at most ``max_images`` images and no video, with reason ``"replay"``; otherwise ``None`` (one eager
    call for the group) and why: ``"video"``, ``"too many images"``, ``"capture failed"`` (a budget in ``failed``,
    whose capture failed, would hold it), ``"no graphs"`` or ``"over budget"``."""
    if video:
        return None, "video"
    if images > max_images:
        return None, "too many images"
    fitting = [b for b in budgets if b >= tokens]
    if fitting:
        return min(fitting), "replay"
    if any(b >= tokens for b in failed):
        return None, "capture failed"
    return None, ("over budget" if budgets else "no graphs")
