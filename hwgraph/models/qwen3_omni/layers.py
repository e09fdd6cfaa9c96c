"""The tower's layers. Attribute names follow transformers' Qwen3-Omni vision encoder, so its state dict loads
unchanged; the forwards are our own, written for few kernels and no host reads (graph capture).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hwgraph.attention.base import VarlenAttention
from hwgraph.models.qwen3_omni.fused import add_layer_norm, linear_gelu_tanh, rotary_qk
from hwgraph.products import linear


def activation(name: str):
    """The block MLP's activation; the common ones directly, anything else through transformers' table."""
    if name == "gelu_pytorch_tanh":
        return partial(F.gelu, approximate="tanh")
    if name == "gelu":
        return F.gelu
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class PatchEmbed(nn.Module):
    """Conv3d whose kernel equals its stride and its input: one patch row times the flattened kernel.

    The weight stays a Conv3d (checkpoint shape ``[hidden, C, tp, p, p]``); the forward is one matmul over its
    ``[hidden, C*tp*p*p]`` view, which is the same sum as the convolution, without conv dispatch.
    """

    def __init__(self, config):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


def rotary_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Float32 inverse frequencies of the axial rotary embedding: each spatial axis gets half the head."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))


class AxialRotary(nn.Module):
    """2-D rotary embedding, as transformers' axial rope: lane ``i < D/2`` of a head (``D`` = head_dim) rotates with
    lane ``i + D/2`` (rotate-half pairs); pairs with ``i < D/4`` rotate by the patch row (lanes ``[0, D/4)`` and
    ``[D/2, 3D/4)``), the others by the column (lanes ``[D/4, D/2)`` and ``[3D/4, D)``).

    ``inv_freq`` is a non-persistent float32 buffer, recomputed after every ``to()``/``to_empty()`` so that a
    bf16 cast never rounds it (transformers keeps it float32 too) and a meta-initialised tower gets real values.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", rotary_inv_freq(head_dim, theta).to(torch.get_default_device()),
                             persistent=False)

    def reset(self, device: torch.device | str | None = None) -> None:
        device = self.inv_freq.device if device is None else torch.device(device)
        if device.type != "meta":
            self.inv_freq = rotary_inv_freq(self.head_dim, self.theta).to(device)

    def _apply(self, fn, recurse=True):
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if not kept.is_meta and self.inv_freq.device == kept.device:
            # Same device (to() of no move, half(), float()): keep the float32 buffer, whose values are reset()'s.
            # A new one would leave graphs captured on the old one reading freed memory, weights unmoved.
            self.inv_freq = kept
        else:
            self.reset()
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[R, 2]`` int -> ``cos``, ``sin`` ``[R, head_dim]`` float32, contiguous. ``sin`` carries the
        sign of the rotation (``-sin`` on the first half), so applying it needs one half-swap instead of a negate and
        a concatenation (``fused.rotary_qk``)."""
        angles = (positions[:, :, None].float() * self.inv_freq).flatten(1)  # [R, head_dim/2]: rows, then cols
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, attend: VarlenAttention) -> torch.Tensor:
        tokens = x.shape[0]
        # [T, 3, H, D] view straight off the matmul: v stays a view; q and k come out rotated (one kernel on GPUs).
        qkv = linear(x, self.qkv.weight, self.qkv.bias).view(tokens, 3, self.num_heads, self.head_dim)
        q, k = rotary_qk(qkv, cos, sin)
        out = attend(q, k, qkv[:, 2], cu_seqlens, max_seqlen, self.scale)
        return linear(out.reshape(tokens, -1), self.proj.weight, self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = activation(config.hidden_act)
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = linear_gelu_tanh(x, self.linear_fc1) if self.gelu_tanh else self.act_fn(self.linear_fc1(x))
        return linear(hidden, self.linear_fc2.weight, self.linear_fc2.bias)


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, attend):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, max_seqlen, attend)
        return x + self.mlp(self.norm2(x))

    def forward_fused(self, x, normed, next_norm, cos, sin, cu_seqlens, max_seqlen, attend):
        """The same block with each residual add fused into the LayerNorm after it. ``normed`` is ``norm1(x)``
        (computed by the previous block's fused add); returns ``(x_out, next_norm(x_out))``, or ``(x_out, None)``
        when ``next_norm`` is None (the last block).

        Submodules run through ``forward`` and their weights through ``products.linear``, not ``Module.__call__``: the
        eager tower is bound by host time, and each module call adds about 5 us of it on the H200's host
        (``benchmarks/host_costs.py``), about 0.7 ms per eager forward. Module hooks on them do not fire here."""
        x, normed = add_layer_norm(x, self.attn.forward(normed, cos, sin, cu_seqlens, max_seqlen, attend), self.norm2)
        delta = self.mlp.forward(normed)
        if next_norm is None:
            return x + delta, None
        return add_layer_norm(x, delta, next_norm)


class PatchMerger(nn.Module):
    """Merges each ``merge x merge`` block of patches (consecutive rows) into one token of ``out_hidden_size``.

    The final merger normalises each patch before the merge; DeepStack mergers (``postshuffle``) normalise the
    concatenated block. The MLP's activation is exact GELU whatever the blocks use (as in the checkpoint's model).
    """

    def __init__(self, config, postshuffle: bool):
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.merged_size if postshuffle else config.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged_size, self.merged_size), nn.GELU(),
                                 nn.Linear(self.merged_size, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln, fc1, fc2 = self.ln_q, self.mlp[0], self.mlp[2]
        if self.postshuffle:
            x = F.layer_norm(x.view(-1, self.merged_size), ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        else:
            x = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps).view(-1, self.merged_size)
        # The Sequential's layers called directly (host time, as in VisionBlock.forward_fused).
        return linear(F.gelu(linear(x, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)
