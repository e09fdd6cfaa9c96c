"""hwgraph backend plugin for npu."""
