"""Layer 3, measurement: ``measure`` (timing over ranks, interleaved rounds, bootstrap intervals, verdicts,
memory, profiles), ``results`` (the environment header and the one JSON layout every benchmark writes),
``harness`` (the one driver every benchmark shares), ``ddp_step`` (one DDP variant's training step as the DDP
benchmarks time it), ``transport_choice`` (the registry's transports as every benchmark's ``--transports``),
``syncbn_verdicts`` (what a SyncBatchNorm run's rows mean and what is judged from them), ``syncbn_report`` (its
printed report), ``collectives`` (what a row of a collectives results file means), ``cluster`` (a
latency-bandwidth model of data parallelism on a cluster), ``backend_latency`` (the "dpkit" backend's per-call
latency and what sets its floor), ``anchors`` (Open MPI's and DeepSpeed's collectives timed beside the backend's)
and ``mpirun`` (a world of MPI ranks started by Open MPI's mpirun)."""
