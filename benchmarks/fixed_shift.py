"""Whole replays with the ping-pong kernel's fixed softmax shift against the online softmax, in one process.

Usage: python benchmarks/fixed_shift.py [TOKENS ...] [--rounds N]   (default 1024 and 512, 2 rounds)
The same as ``python benchmarks/replay_toggle.py fixed-shift ...`` (see there): the graph captured as shipped
against one captured with ``gluon_kernel.FIXED_SHIFT_FROM`` raised past every budget (the online softmax and no
fixup launch, the kernel before session 13), timed side by side, and both against the transformers reference.
"""

from __future__ import annotations

import sys

from replay_toggle import main  # benchmarks/, the script's directory

if __name__ == "__main__":
    sys.argv[1:1] = ["fixed-shift"]
    main()
