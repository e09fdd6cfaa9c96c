"""Optional integrations with serving engines. Each submodule imports its engine; this package imports none.

- ``hwgraph.integrations.vllm``: vLLM's encoder CUDA graph protocol for the Qwen3-Omni image tower, and a
  single-replay ``EncoderCudaGraphManager`` (``pip install 'hwgraph[vllm]'``).
"""
