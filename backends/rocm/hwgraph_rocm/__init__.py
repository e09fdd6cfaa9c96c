"""hwgraph backend plugin for rocm."""
