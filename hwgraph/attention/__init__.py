"""Varlen attention: one signature, a registry of kernels with capability gates."""

from hwgraph.attention.base import KernelSpec, VarlenAttention
from hwgraph.attention.registry import choose_attention, kernel_named, kernel_specs, list_kernels

__all__ = ["KernelSpec", "VarlenAttention", "choose_attention", "kernel_named", "kernel_specs", "list_kernels"]
