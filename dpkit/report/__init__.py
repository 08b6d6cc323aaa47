"""Layer 5, the report: ``plots`` (one function per figure, from result documents) and ``summary`` (README's
headline block, rendered from the verdicts the benchmarks stored)."""
