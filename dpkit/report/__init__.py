"""Layer 5, the report: ``plots`` (one style, one function per figure, from result documents),
``collective_plots`` (the collectives' charts), ``ddp_tables`` (the DDP benchmark's tables, PyTorch's formats
among them), ``ddp_printout`` (what ddp_benchmark.py prints: its header, legend, tables and targets),
``sharding_printout`` (what sharding_benchmark.py prints: its rows, targets by axis and memory notes),
``findings`` (the facts behind every sentence, computed from rows), ``paths`` (which path a shared-memory row
took), ``sentences`` (the report's computed sentences), ``summary`` (README's headline block, rendered from
the verdicts the benchmarks stored) and ``backend_lines`` (README's results of the backend "dpkit", from its
files).

report.ipynb's cells are calls into one section module each, writing to a ``page`` (result files in, markdown
and compact images out) in the report's words (``wording``): ``overview`` (what ran, and README's block as the
summary), ``syncbn_section`` and ``syncbn_detail``, ``training_section``, ``allreduce_section``,
``collective_section``, ``ddp_section``, ``ddp_formats``, ``sharding_section`` and ``multihost_section``."""
