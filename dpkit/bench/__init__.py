"""Layer 3, measurement: ``measure`` (timing over ranks, interleaved rounds, bootstrap intervals, verdicts,
memory, profiles), ``results`` (the environment header and the one JSON layout every benchmark writes),
``harness`` (the one driver every benchmark shares), ``transport_choice`` (the registry's transports as every
benchmark's ``--transports``), ``row_identity`` (a row's identity as fields, and the one function that formats
its label).

Each benchmark script is a command line over its modules here, named by the benchmark (README's table gives
each module's one line):
- DDP: ``ddp_step`` (the training step), ``ddp_variants`` (rows, labels, rounds' order), ``ddp_replicas``,
  ``ddp_memory``, ``ddp_run`` (measuring), ``ddp_targets`` (ratios and checks);
- sharding: ``sharding_setups`` (each engine on a rank), ``sharding_variants`` (engine, impl, option,
  transport, label), ``sharding_memory``, ``sharding_run``, ``sharding_targets``;
- SyncBatchNorm: ``syncbn_contenders`` (the layers, their code passed in), ``syncbn_floor``,
  ``syncbn_baseline``, ``syncbn_operators``, ``syncbn_case``, ``syncbn_phases``, ``syncbn_run``,
  ``syncbn_verdicts`` (what is judged), ``syncbn_report``;
- collectives: ``collectives`` (what a row means), ``exact_pattern``, ``collective_run``, its axes
  ``algorithm_axis``, ``transport_axis`` and ``backend_axis``, ``point_to_point``, ``crossover_table``,
  ``latency_model`` (the algorithms' T = steps x alpha + bytes x beta), ``collective_targets``,
  ``collective_tables``, ``backend_latency``, ``anchors`` (Open MPI's and DeepSpeed's collectives beside the
  backend's), ``mpirun`` and ``peer_read`` (why no single copy);
- beyond one host: ``cluster`` (a latency-bandwidth model of data parallelism on a cluster)."""
