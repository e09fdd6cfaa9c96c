"""The conformance suite vendors run against their graph backend (pytest plugin ``hwgraph``)."""
