"""``hwgraph bench``: measured side-by-side comparisons (filled in by the benchmark issue)."""


def register_cli(sub) -> None:
    return None
