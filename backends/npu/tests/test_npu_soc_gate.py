"""Review findings on the npu plugin, each checked against the vendor's published facts."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from hwgraph.platform import PlatformInfo

ASCEND = PlatformInfo("npu", "Ascend310P7", "Ascend310P7", torch.__version__, "CANN", "8.3.RC1", 1)


@pytest.mark.parametrize("soc", [204, 205, 206])
def test_npu_attention_refuses_every_ascend_310p_soc_version(monkeypatch, soc):
    """torch_npu's SocVersion numbers Ascend310P5 204 and Ascend310P7 205 (206 in some releases), and vllm-ascend maps
    200-205 to the 310P; the gate refused 200-204 only, so a 310P7 was offered the TND kernel it lacks."""
    from hwgraph_npu.attention import npu_gate

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = lambda *args, **kwargs: None
    fake.npu = types.SimpleNamespace(get_soc_version=lambda: soc)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    (reason,) = npu_gate(ASCEND).reasons
    assert reason.endswith(f"this one is an Ascend 310P (SoC version {soc})"), reason
    fake.npu = types.SimpleNamespace(get_soc_version=lambda: 223)  # an Ascend910B3 (Atlas A2) is still served
    assert npu_gate(dataclasses.replace(ASCEND, device_name="Ascend910B3", arch="Ascend910B3")).ok
