"""Layer 2, the data-parallel engines, each taking its communication as a ``transport``: ``ddp`` (gradients
averaged in buckets during backward), ``zero`` (ZeRO stage 1: sharded optimizer state), ``fsdp`` (parameters,
gradients and optimizer state sharded)."""
