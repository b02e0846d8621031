"""Two gloo processes; rank 1 dies (os._exit) after the first all-reduce and rank 0's next
collective fails. Rank 0 prints whether engine.distributed.lost_peer recognises the failure and
the message a job log would end with. Started by tests/engine/test_distributed_env.py with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set."""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

from engine.distributed import lost_peer, lost_peer_message

dist.init_process_group("gloo")
x = torch.ones(4)
dist.all_reduce(x)
if dist.get_rank() == 1:
    os._exit(1)  # a node or task dies without a word
try:
    for _ in range(100):
        dist.all_reduce(x)
except Exception as e:  # the point of the script
    print("lost_peer:", lost_peer(e))
    print(lost_peer_message(e, "python -m pretrain", "run/checkpoints/step_00000010"))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.exit(0)
print("no failure seen")
sys.exit(1)
