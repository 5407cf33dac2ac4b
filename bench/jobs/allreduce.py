"""Tiny torchrun job for launch benchmarks: one gloo all-reduce of ones, then exit."""
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")  # rank, world size and master from torchrun's env
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            world = dist.get_world_size()
            print(f"allreduce sum={t.sum().item():.0f} expected={4 * world} world={world} "
                  f"host={os.environ.get('MASTER_ADDR')}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
