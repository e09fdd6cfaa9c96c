"""A deliberately broken graph backend: each graph replays correctly once, then its outputs go stale.

The manager verifies every capture with one replay against eager, so a backend that is wrong from the start is
refused at capture; this one passes that check and breaks afterwards, which only the conformance suite can catch.
"""
