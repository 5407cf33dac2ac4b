"""Launch timeline job: each rank prints `first-line` with its clock before importing
torch (the earliest a launcher can get a rank to speak), then `imported` and `joined`
after torch's import and the gloo group's start; rank 0 then prints the all-reduce, and
every rank `end` with its clock as its last act (the start of its interpreter's end)."""
import os
import time

RANK = os.environ["RANK"]
print(f"first-line rank={RANK} t={time.time():.6f}", flush=True)

import torch  # noqa: E402  (after the first line, on purpose)
import torch.distributed as dist  # noqa: E402

print(f"imported rank={RANK} t={time.time():.6f}", flush=True)
dist.init_process_group("gloo")
print(f"joined rank={RANK} t={time.time():.6f}", flush=True)
try:
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"allreduce sum={t.sum().item():.0f} expected={4 * world} world={world}",
              flush=True)
finally:
    dist.destroy_process_group()
    print(f"end rank={RANK} t={time.time():.6f}", flush=True)
