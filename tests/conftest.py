"""Test-session settings for the CPU suite."""

import torch

# Two cores run two xdist workers: one intra-op thread each avoids oversubscription (10x slower otherwise).
torch.set_num_threads(1)
