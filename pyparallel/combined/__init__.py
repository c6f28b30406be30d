"""DP x TP x PP (+ ZeRO 1/2, mixed precision) on one mesh: the machinery behind
:func:`pyparallel.parallelize` (``pyparallel/parallel.py``). See docs/combined.md."""
