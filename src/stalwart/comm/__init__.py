"""Training over lossy networks: UDP collectives with unbiased aggregation and bounded drift.

Implements "Distributed Training under Packet Loss" (Weintraub, Banner, Orda, 2025) with
OptiReduce-style deadlines: see docs/comm.md. Usage from any DDP script::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = stalwart.comm.attach(ddp, torch.optim.AdamW, lr=3e-4)

Modules: ``wire`` (packet format, authentication, parser), ``transport`` (UDP, batched system
calls, receiving thread), ``layout`` (shards and chunks), ``aggregate`` (unbiased per-chunk
average), ``deadline`` (adaptive agreed deadlines), ``collective`` (reduce-scatter + broadcast),
``optim`` (owner update + parameter broadcast), ``ddp`` (``attach``).
"""

from stalwart.comm.collective import LossyCollective
from stalwart.comm.ddp import attach
from stalwart.comm.optim import ShardedLossyOptimizer

__all__ = ["attach", "LossyCollective", "ShardedLossyOptimizer"]
