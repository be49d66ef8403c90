"""Multi-host start-up: the same program runs on every host and sees one global device list.

Call `initialize()` first thing on every host (before any other JAX call). With no arguments it
reads `GPTOSS_COORDINATOR` (`host:port` of process 0), `GPTOSS_NUM_PROCESSES` and
`GPTOSS_PROCESS_ID`; with none of those set it leaves JAX to detect a cluster (SLURM, Open MPI,
...) when `GPTOSS_AUTO_CLUSTER=1`, and otherwise does nothing (single host). After it,
`jax.devices()` lists every host's devices and `sharding.rules.make_mesh` spans them; each host
feeds and reads only its addressable shards. See docs/SCALING.md for a launch recipe.
"""

from __future__ import annotations

import os

import jax


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Join the multi-host job if one is configured. Returns whether JAX runs distributed."""
    coordinator = coordinator or os.environ.get("GPTOSS_COORDINATOR")
    if num_processes is None and os.environ.get("GPTOSS_NUM_PROCESSES"):
        num_processes = int(os.environ["GPTOSS_NUM_PROCESSES"])
    if process_id is None and os.environ.get("GPTOSS_PROCESS_ID"):
        process_id = int(os.environ["GPTOSS_PROCESS_ID"])
    if coordinator is None and num_processes is None and process_id is None:
        if os.environ.get("GPTOSS_AUTO_CLUSTER") == "1":
            jax.distributed.initialize()
            return True
        return False
    missing = [
        n
        for n, v in (("coordinator", coordinator), ("num_processes", num_processes), ("process_id", process_id))
        if v is None
    ]
    if missing:
        raise ValueError(
            f"multi-host start needs coordinator, num_processes and process_id; missing {missing} "
            "(set GPTOSS_COORDINATOR, GPTOSS_NUM_PROCESSES, GPTOSS_PROCESS_ID)"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")) == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts talk over TCP
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True
