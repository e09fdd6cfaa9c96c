"""What the tower returns: merged image embeddings and the DeepStack features, one row per merged token."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)  # no tensor comparisons
class VisionOutput:
    """``embeds`` ``[tokens, out_hidden]`` (the merger's output) and ``deepstack``, one ``[tokens, out_hidden]``
    tensor per DeepStack merger, in block order."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(embeds, *deepstack)``: the form a captured callable returns."""
        return (self.embeds, *self.deepstack)

    def split(self, token_counts: Sequence[int]) -> list[VisionOutput]:
        """One output per image (views, no copies). Rows past ``sum(token_counts)`` (padding) are dropped."""
        if not isinstance(token_counts, Iterable) or isinstance(token_counts, (str, bytes)):
            raise ValueError(f"token counts must be a sequence of ints, one per image, got {token_counts!r}")
        token_counts = list(token_counts)  # a generator is read once: the message below shows all of it
        # int() truncated a fractional count (2.5 gave 2 rows) and operator.index takes a bool as 1: both silently
        if any(isinstance(n, bool) or (isinstance(n, torch.Tensor) and n.dtype == torch.bool) for n in token_counts):
            raise ValueError(f"token counts must be ints, got {token_counts}")
        try:
            counts = [operator.index(n) for n in token_counts]
        except TypeError:
            raise ValueError(f"token counts must be ints, got {token_counts}") from None
        if any(n < 0 for n in counts) or sum(counts) > self.num_tokens:
            raise ValueError(f"token counts {counts} (sum {sum(counts)}) do not fit in {self.num_tokens} rows")
        parts, start = [], 0
        for n in counts:
            parts.append(VisionOutput(self.embeds[start:start + n],
                                      tuple(d[start:start + n] for d in self.deepstack)))
            start += n
        return parts

    def clone(self) -> VisionOutput:
        return VisionOutput(self.embeds.clone(), tuple(d.clone() for d in self.deepstack))
