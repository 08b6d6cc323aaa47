"""A torchrun probe of the simulated hosts: each rank prints its host, what "auto" made, and whether an
all-reduce through it is exact.

    DPKIT_HOSTS=2,2 torchrun --standalone --nproc_per_node=4 tests/hosts_probe.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dpkit.comm import hosts, transport  # noqa: E402
from dpkit.comm.process_groups import distributed  # noqa: E402

if __name__ == "__main__":
    with distributed(backend="gloo") as ctx:
        where = hosts.host_indices()
        chosen = transport.resolve("auto")
        x = torch.arange(1001, dtype=torch.float64) * (ctx.rank + 1)
        chosen.all_reduce(x)
        exact = torch.equal(x, torch.arange(1001, dtype=torch.float64) * sum(range(1, ctx.world_size + 1)))
        line = (f"rank {ctx.rank}: host {where[ctx.rank]} of {where}, auto = {chosen.describe()}, all-reduce "
                f"{'exact' if exact else 'WRONG'}\n")
        sys.stdout.write(line)  # one write: the ranks share torchrun's stdout
        sys.stdout.flush()
