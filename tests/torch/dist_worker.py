"""One rank of the facade's multi-process tests: ``python -m tests.torch.dist_worker SUITE...``.

Launched on 2 local processes by ``tests/torch/conftest.py`` (one process group for every case, gloo on
127.0.0.1). Prints ``RESULT <json>`` mapping each suite to its results on this rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.torch.dist_found_inf_cases import found_inf_suite, group_suite
from tests.torch.dist_sharded_cases import sharded_suite

SUITES = {"found_inf": found_inf_suite, "group": group_suite, "sharded": sharded_suite}


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2's default mesh
    results = {name: SUITES[name](rank) for name in sys.argv[1:]}
    dist.barrier()
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)  # skip the slow interpreter teardown of gloo's threads


if __name__ == "__main__":
    main()
