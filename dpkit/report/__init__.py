"""Layer 5, the report: ``plots`` (one style, one function per figure, from result documents),
``collective_plots`` (the collectives' charts), ``ddp_tables`` (PyTorch's DDP benchmark formats),
``findings`` (the facts behind every sentence, computed from rows), ``paths`` (which path a shared-memory row
took), ``sentences`` (the report's computed sentences) and ``summary`` (README's headline block, rendered from
the verdicts the benchmarks stored)."""
