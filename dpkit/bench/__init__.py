"""Layer 3, measurement: ``measure`` (timing over ranks, interleaved rounds, bootstrap intervals, verdicts,
memory, profiles), ``results`` (the environment header and the one JSON layout every benchmark writes),
``harness`` (the one driver every benchmark shares), ``ddp_step`` (one DDP variant's training step as the DDP
benchmarks time it), ``ddp_variants`` (the DDP benchmark's rows: each variant, its bucket sizes, transports and
label, and the rounds' order), ``ddp_replicas`` (a variant's model, batch and engine on one rank), ``ddp_memory``
(a replica's peak memory and the buffers its DDP keeps), ``ddp_run`` (measuring one model's variants into rows),
``ddp_targets`` (each row's ratios to no DDP and to PyTorch's DDP, and the target checks), ``syncbn_verdicts``
(what a SyncBatchNorm run's rows mean and what is judged from them), ``syncbn_report`` (its printed report),
``transport_choice`` (the registry's transports as every benchmark's ``--transports``), ``collectives`` (what a
row of a collectives results file means), ``cluster`` (a latency-bandwidth model of data parallelism on a
cluster), ``backend_latency`` (the "dpkit" backend's per-call latency and what sets its floor), ``anchors`` (Open
MPI's and DeepSpeed's collectives timed beside the backend's) and ``mpirun`` (a world of MPI ranks started by
Open MPI's mpirun)."""
