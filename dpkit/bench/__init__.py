"""Layer 3, measurement: ``measure`` (timing over ranks, interleaved rounds, bootstrap intervals, verdicts,
memory, profiles) and ``results`` (the environment header and the one JSON layout every benchmark writes)."""
