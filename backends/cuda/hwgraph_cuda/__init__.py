"""hwgraph backend plugin for cuda."""
