"""Graph-ready model towers."""
