"""Traces users already have: a past job's per-operation trace through a stated rule.

``stalwart replay --trace FILE`` reads a columnar trace (CSV or parquet: rank, step, name,
start, duration, optionally micro) or PyTorch profiler (Kineto) Chrome-trace JSON, maps each
operation name to compute, communication or neither (``opnames``), places every rank in the
job's DP x PP x TP layout (``layout``) and decides, from the trace's own evidence, between a
slow rank, a slow tensor-parallel group or host, a pipeline-stage imbalance, an input
(sequence-length) imbalance and a clean job (``verdict``). Reading is in ``read``; the
decision is pure and torch-free (this package imports no torch: pyproject's contracts).
"""
