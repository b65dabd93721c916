"""Communication hiding by strand interleaving (DHelix, arXiv 2411.15871).

Tensor-parallel layers whose collectives are explicit and asynchronous (``layers``), the
reference GPT built from them (``tpgpt``), a two-strand executor that co-executes the forward of
micro-batch k+1 with the backward of micro-batch k so that each strand's collectives travel
while the other computes (``strands``, ``executor``), a pairwise overlap profiler and the
dynamic-programming plan search (``profiler``, ``plan``), and an activation-memory meter
(``memory``). ``build_tp_trainer`` is the seam the training worker uses; ``Interleaved`` is
the library entry point for a user's own TP model built from our parallel layers.
"""

from stalwart.overlap.comm import TPComm
from stalwart.overlap.executor import SCHEDULES, Interleaved
from stalwart.overlap.layers import ColumnParallelLinear, RowParallelLinear
from stalwart.overlap.plan import Plan, Profile, load_plan, save_plan, search
from stalwart.overlap.tpgpt import TPGPT
from stalwart.overlap.trainer import TPTrainer, build_tp_trainer, tp_grad_norm

__all__ = [
    "SCHEDULES", "TPComm", "Interleaved", "ColumnParallelLinear", "RowParallelLinear", "Plan",
    "Profile", "load_plan", "save_plan", "search", "TPGPT", "TPTrainer", "build_tp_trainer",
    "tp_grad_norm",
]
