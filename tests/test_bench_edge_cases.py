"""``hwgraph bench``'s options at their edges: refused with the value named and what was expected (exit 2, nothing
built), never dropped or turned into a traceback. Each test failed on the code before its fix."""

from __future__ import annotations

import pytest

from hwgraph import bench_command, cli
from hwgraph.bench import Group, parse_groups


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("bad arguments must be refused before anything is built or run")

    monkeypatch.setattr(bench_command, "run_bench", refuse)


def test_a_group_number_longer_than_int_reads_is_refused_naming_the_group(capsys):
    """Past 4300 digits int() raised its own error: the message named no group and pointed at
    sys.set_int_max_str_digits; leading zeros of a small number failed the same way."""
    huge = "1x" + "9" * 5000
    with pytest.raises(ValueError, match=r"^group '1x9{5000}' in '1x9{5000}' is too large: 9{5000} is past the "
                                         r"2147483647 patch rows one call takes \(int32 cu_seqlens\)$"):
        parse_groups(huge)
    assert parse_groups("1x" + "0" * 5000 + "4, 02x8") == [Group(1, 4), Group(2, 8)]
    assert cli.main(["bench", "--groups", "4x16," + "9" * 5000 + "x1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hwgraph bench: --groups: group '{'9' * 5000}x1' in '4x16,") and "set_int_max" not in err


@pytest.mark.parametrize("argv, refusal", [
    (["--attention", "TORCH_SDPA", "--attention", "torch_sdpa"],
     "--attention TORCH_SDPA torch_sdpa: TORCH_SDPA repeats; give each kernel once"),
    (["--budgets", "8", "--budgets", "8"], "--budgets: budgets must not repeat, got duplicates [8] in [8, 8]"),
])
def test_a_list_option_given_twice_adds_to_its_list(argv, refusal, capsys):
    """argparse kept only the last occurrence: '--attention TORCH_SDPA --attention TRITON_ATTN' benched TRITON_ATTN
    alone, and a repeated kernel or budget passed the checks for repeats."""
    args = cli.build_parser().parse_args(["bench", "--attention", "TORCH_SDPA", "--attention", "TRITON_ATTN",
                                          "--budgets", "16", "--budgets", "8", "32"])
    assert args.attention == ["TORCH_SDPA", "TRITON_ATTN"] and args.budgets == [16, 8, 32]
    assert cli.main(["bench", "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"hwgraph bench: {refusal}"



def test_validates_list_options_given_twice_add_to_their_lists():
    """As bench's: '--attention A --attention B' validated B alone, and '--tokens 49 --tokens 256' benchmarked 256."""
    args = cli.build_parser().parse_args(["validate", "--attention", "TORCH_SDPA", "--attention", "TRITON_ATTN",
                                          "--tokens", "49", "--tokens", "256", "1024"])
    assert args.attention == ["TORCH_SDPA", "TRITON_ATTN"] and args.tokens == [49, 256, 1024]


def test_groups_given_twice_add_to_the_groups(capsys):
    """argparse kept only the last --groups: '--groups 1x49 --groups 1x256' benched 1x256 alone and dropped 1x49
    without a word, as --attention and --budgets did before they extended their lists."""
    args = cli.build_parser().parse_args(["bench", "--device", "cpu", "--groups", "1x4", "--groups", "2x8,1x16"])
    assert [g.label for g in bench_command.config_from_args(args).groups] == ["1x4", "2x8", "1x16"]
    assert cli.main(["bench", "--device", "cpu", "--groups", "1x4", "--groups", "1X4"]) == 2
    assert capsys.readouterr().err.strip() == ("hwgraph bench: --groups: group 1x4 repeats in '1x4,1X4': each group "
                                              "is one row of the table")


def test_a_blank_backend_variable_is_unset_for_the_bench_errors_prefix_too(monkeypatch):
    """$HWGRAPH_GRAPH_BACKEND set blank is unset (hwgraph.registry.backend_from_variable): an automatic choice's
    refusal of --graph-mode says so, as with the variable unset, not as if the variable had named the backend."""
    import torch

    from hwgraph import bench_command, registry

    def refuse(name=None, device=None, mode=None, platform=None):
        raise registry.SelectionError("the runtime has no graph API")

    monkeypatch.setattr(registry, "create_backend", refuse)
    for value in (None, " "):
        if value is None:
            monkeypatch.delenv(registry.GRAPH_BACKEND_ENV, raising=False)
        else:
            monkeypatch.setenv(registry.GRAPH_BACKEND_ENV, value)
        with pytest.raises(ValueError, match=r"^--graph-mode 'aclgraph': the runtime has no graph API$"):
            bench_command.check_backend_builds(None, "aclgraph", torch.device("cpu"))
