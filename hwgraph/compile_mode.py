"""Compiled mode's dynamo settings: one compiled block forward per manager, under a recompile limit sized to it."""

from __future__ import annotations

import contextlib
import types

import torch


def compile_block_forward(fn):
    """``torch.compile(fn, dynamic=False)`` on a copy of ``fn`` with a code object of its own (``own_code_copy``)."""
    return torch.compile(own_code_copy(fn), dynamic=False)


def own_code_copy(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object: with a copy, this
    manager's compilations neither reuse nor count against those of other managers (another attention kernel or
    tower in the same process), so ``compile_limits`` can size the recompile limit to this manager alone."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@contextlib.contextmanager
def compile_limits(num_budgets: int):
    """Room for every budget's compiled graphs (two per budget) under dynamo's recompile limit, and a hard error
    instead of a silent eager fallback if it is hit anyway (the capture then fails and is logged)."""
    wanted = {"recompile_limit": max(8, 2 * num_budgets + 2), "fail_on_recompile_limit_hit": True}
    config = torch._dynamo.config
    with config.patch({k: v for k, v in wanted.items() if hasattr(config, k)}):
        yield
