"""Layer 1, communication: ``process_groups`` (set-up, launching, peer failures), ``checks`` (what every
collective refuses before its first message), ``hosts`` (which rank is on which host), ``comm_thread`` (a
transport's collectives in the background), and the transports: ``interface`` (what a transport is),
``torch_transport``, ``shared_memory``, ``message_passing`` ("p2p"), ``hierarchical``, ``registry`` (the one
place a transport is chosen, by name or "auto"), ``pytorch_adapters`` (PyTorch's DDP and fully_shard over a
transport) and ``transport``, which names all of them in one place; ``backend`` (the torch.distributed
backend "dpkit": unchanged PyTorch code over this host's shared memory), ``backend_work`` (its works and the
queue that runs each group's calls in order) and ``slots`` (its shared-memory
engine for small messages); ``shared_file`` (the file one rank makes and its peers map, with no name, and
the wait in it) under both ``slots`` and ``shared_memory``."""
