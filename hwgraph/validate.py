"""``hwgraph validate``: the vendor validation report (filled in by the validation issue)."""


def register_cli(sub) -> None:
    return None
