"""Layer 3, measurement: ``measure`` (timing over ranks, interleaved rounds, bootstrap intervals, verdicts,
memory, profiles), ``results`` (the environment header and the one JSON layout every benchmark writes),
``harness`` (the one driver every benchmark shares), ``transport_choice`` (the registry's transports as every
benchmark's ``--transports``).

DDP: ``ddp_step`` (one DDP variant's training step as the DDP benchmarks time it), ``ddp_variants`` (the DDP
benchmark's rows: each variant, its bucket sizes, transports and label, and the rounds' order), ``ddp_replicas``
(a variant's model, batch and engine on one rank), ``ddp_memory`` (a replica's peak memory and the buffers its
DDP keeps), ``ddp_run`` (measuring one model's variants into rows), ``ddp_targets`` (each row's ratios to no DDP
and to PyTorch's DDP, and the target checks).

SyncBatchNorm: ``syncbn_verdicts`` (what a SyncBatchNorm run's rows mean and what is judged from them),
``syncbn_report`` (its printed report).

Collectives: ``collectives`` (what a row of a collectives results file means), ``exact_pattern`` (the pattern
every collective is checked on, exact in float32), ``collective_run`` (one size of a collectives comparison:
check, time in turns, one row each), its three axes ``algorithm_axis`` (the point-to-point all-reduces against
torch's), ``transport_axis`` (the registry's transports) and ``backend_axis`` (torch.distributed on a "dpkit"
group against gloo), ``point_to_point`` (one exchange step of our engine against one of gloo's),
``crossover_table`` (auto's table from measured rows), ``collective_targets`` (the collectives' targets and
verdicts), ``collective_tables`` (the collectives benchmark's printed report), ``backend_latency`` (the "dpkit"
backend's per-call latency and what sets its floor), ``anchors`` (Open MPI's and DeepSpeed's collectives timed
beside the backend's) and ``mpirun`` (a world of MPI ranks started by Open MPI's mpirun).

Beyond one host: ``cluster`` (a latency-bandwidth model of data parallelism on a cluster)."""
