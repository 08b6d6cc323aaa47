"""Layer 2, the data-parallel engines, each taking its communication as a transport (``dpkit.comm``): ``ddp``
(gradients averaged in buckets during backward), ``zero`` (ZeRO stages 1 and 2: sharded optimizer state, and in
stage 2 gradients too), ``fsdp`` (parameters, gradients and optimizer state sharded; HSDP inside a host).
``registry`` names them once (ddp, zero1, zero2, fsdp, hsdp, each ours or PyTorch's), for every flag, results
field and legend; ``makers`` builds each by name."""
