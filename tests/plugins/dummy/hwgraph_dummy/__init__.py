"""A dummy hwgraph backend plugin, installed only by tests/test_plugin_discovery.py."""
