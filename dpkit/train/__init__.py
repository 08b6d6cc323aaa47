"""Layer 4, training: the pieces ``ddp_cifar100.py`` assembles, one concept per module: ``data`` (CIFAR-100 or
its synthetic stand-in, each rank's share), ``parallel`` (the engine, by name), ``step`` (accumulation with
``no_sync()``, the optimizer step), ``validation`` (scattered, exact sums), ``checkpoint`` (durable saves,
resume) and ``metrics`` (time and memory over ranks, the closing lines)."""
