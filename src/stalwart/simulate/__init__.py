"""Trace-driven simulation of hybrid-parallel training at 1k-10k+ ranks that drives the
product's own decision code (detector, planner, policy): ``stalwart simulate``.

Modules: ``model`` (step time), ``faults`` (FALCON-drawn and scripted), ``noise`` (measured
per-rank noise), ``decide`` (the adapter to detect/ and mitigate/), ``engine`` (the step loop),
``calibrate`` (against recorded testbed runs), ``run`` (scenarios, figures, run directory).
"""
