"""dpkit: data-parallel training in PyTorch, written out to be read and measured.

The layers, each importing only the ones before it:

    dpkit.compat    the torch releases the kit runs on (refused at import where older) and their names
    dpkit.native    C helpers compiled at first use where a C compiler is, each beside a PyTorch path
    dpkit.comm      process groups, the checks every collective makes, and transports: how ranks move and
                    sum tensors (torch.distributed; shared memory on one host; others registered by name)
    dpkit.engines   the data-parallel engines: DDP (and its naive and flat baselines), ZeRO stages 1 and 2, FSDP
    dpkit.models    the workloads the trainer and the benchmarks run
    dpkit.bench     measurement (timing, intervals, verdicts, memory, profiles) and the results layout
    dpkit.train     what the CIFAR-100 trainer assembles: data, the engine by name, the step, validation,
                    checkpoints, its metrics
    dpkit.report    drawing the report and README's headline block from results/

What a user runs lives beside the package: the homework scripts (``sequential_print.py``, ``syncbn.py``,
``ddp_cifar100.py``, ``allreduce.py``), the benchmarks and ``run_experiments.py``.

    import dpkit                       # registers the torch.distributed backend "dpkit"
    dist.init_process_group("dpkit")   # unchanged PyTorch code over this host's shared memory
    from dpkit.engines.ddp import DDP
    model = DDP(net)                   # a drop-in for torch.nn.parallel.DistributedDataParallel
"""

from dpkit import compat  # noqa: F401  (first: a torch older than the supported range fails here, saying so)
from dpkit.comm import backend  # noqa: E402,F401  (last: registers the torch.distributed backend "dpkit")
