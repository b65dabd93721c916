"""NVIDIA's straggler detector (nvidia-resiliency-ext 0.4.1) attached to a rank, for
``stalwart bench detect`` only (rank side; the bench side is ``nvrx_reports``).

Mechanism: ``nvidia_resiliency_ext.straggler.Detector`` times *detection sections* on every
rank and, every ``REPORT_S`` seconds, scores each rank's median section time against the best
rank's (relative score) and against its own best (individual score); a score below 0.75
(``Report.identify_stragglers``' default) names the rank a straggler. The harness wires it
into any DDP training loop without a code change in the loop:

- section ``fwd``: every ``DistributedDataParallel.forward`` call, through the package's own
  ``Detector.wrap_callables`` / ``CallableId`` (its usage guide: "the simplest approach might
  be to wrap the model's forward call"; its example times ``ddp_model(data)`` as "fwd"; its
  Lightning callback wraps ``training_step``, i.e. forward + loss). No collective runs in it
  -- except DDP's buffer broadcast at the start of a forward when the model has buffers
  (BatchNorm), which stays in, as it would for a user;
- section ``step``: the whole iteration, from one optimizer step to the next (forward,
  backward with its gradient all-reduce, optimizer step) -- what a user timing "the training
  step" gets; measured to show why the documented choice matters;
- reports: ``Detector.generate_report_if_interval_elapsed()`` after every optimizer step
  (``torch.optim``'s global step post-hook), ``report_time_interval=REPORT_S``,
  ``gather_on_rank0=True``, both score kinds; rank 0 appends each report to
  RUN_DIR/``nvrx.jsonl`` (wall time, iteration, scores, the ranks flagged per section and
  score kind, the report's own time) and, at exit, its per-iteration CPU cost to
  RUN_DIR/``nvrx_cost.json``.

CPU-only harness (0.4.1 has no CPU mode): three calls are made harmless when CUDA is not
available -- ``Detector.initialize`` builds a CUPTI manager (its extension needs libcupti): a
stub that profiles nothing replaces it (every section is ``profile_cuda=False`` anyway);
``generate_report`` calls ``torch.cuda.synchronize()`` and the report-interval tracker moves a
tensor to ``torch.cuda.current_device()``: those two modules see a ``torch`` whose ``cuda``
namespace synchronises nothing and names the CPU. Nothing else of the package is changed, and
the global ``torch`` is untouched.

Cost (what the bench reports as ``nvrx_step_cpu_us``): the thread CPU time rank 0 spends in
the section bookkeeping and the report call, per iteration.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

from stalwart.bench.peers.nvrx_reports import COST, REPORTS

ENV = "STALWART_BENCH_NVRX"  # set (to "1") by the bench: attach the detector in the ranks
VERSION = "0.4.1"
REPORT_S = 5.0
THRESHOLD = 0.75  # Report.identify_stragglers' default, for every score kind
SECTIONS = ("fwd", "step")
CPU_NOTE = ("nvrx 0.4.1 has no CPU mode: in the bench's ranks, its CUPTI manager is a stub, "
            "and torch.cuda.synchronize / current_device are made harmless inside its modules")


class _NoCupti:
    """CuptiManager without CUPTI: no kernel is ever profiled (sections use profile_cuda=False)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def initialize(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def start_profiling(self) -> None:
        pass

    def stop_profiling(self) -> None:
        pass

    def get_results(self) -> dict[str, Any]:
        return {}

    def reset_results(self) -> None:
        pass


class _CpuTorch(types.ModuleType):
    """``torch`` as nvrx's straggler and interval-tracker modules see it on a CPU machine."""

    def __init__(self, torch: Any) -> None:
        super().__init__("torch")
        self._torch = torch
        self.cuda = types.SimpleNamespace(synchronize=lambda *a, **k: None,
                                          current_device=lambda: "cpu",
                                          is_available=lambda: False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def make_cpu_safe() -> bool:
    """The three patches above, when CUDA is not available; returns whether they were made."""
    import torch
    from nvidia_resiliency_ext.straggler import interval_tracker, straggler

    if torch.cuda.is_available():
        return False
    straggler.CuptiManager = _NoCupti  # type: ignore[assignment,misc]
    shim = _CpuTorch(torch)
    straggler.torch = shim  # type: ignore[assignment]
    interval_tracker.torch = shim  # type: ignore[assignment]
    return True


class Harness:
    """The detector on one rank: sections on DDP's forward and on the whole iteration, a
    report check after every optimizer step; rank 0 logs reports and its own cost."""

    def __init__(self, run_dir: Path, rank: int, report_s: float = REPORT_S) -> None:
        self.run_dir, self.rank, self.report_s = run_dir, rank, report_s
        self.iteration = 0
        self.costs: list[float] = []  # per iteration, seconds of thread CPU time (rank 0)
        self.report_ms: list[float] = []
        self._pending = 0.0  # section bookkeeping since the last optimizer step
        self._step_cm: Any = None
        self._det: Any = None

    def install(self) -> None:
        import torch.optim.optimizer as optim
        from nvidia_resiliency_ext import straggler
        from torch.nn.parallel import DistributedDataParallel as DDP

        make_cpu_safe()
        det = straggler.Detector
        det.initialize(scores_to_compute="all", gather_on_rank0=True,
                       report_time_interval=self.report_s, node_name=f"host{self.rank}")
        self._det = det
        orig = DDP.forward
        harness = self

        def forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            cm = det.detection_section("fwd", profile_cuda=False)
            cm.__enter__()
            harness._pending += time.thread_time() - c0
            try:
                out = orig(ddp, *args, **kwargs)
            except BaseException as e:
                cm.__exit__(type(e), e, e.__traceback__)
                raise
            c0 = time.thread_time()
            cm.__exit__(None, None, None)
            harness._pending += time.thread_time() - c0
            return out

        # what Detector.wrap_callables([CallableId(DDP, "forward")]) installs, with the
        # bookkeeping timed apart from the forward itself
        DDP.forward = forward  # type: ignore[method-assign]
        optim.register_optimizer_step_post_hook(self._after_step)
        self._enter_step()
        if self.rank == 0:
            atexit.register(self.write_cost)

    def _enter_step(self) -> None:
        self._step_cm = self._det.detection_section("step", profile_cuda=False)
        self._step_cm.__enter__()

    def _after_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        c0 = time.thread_time()
        self._step_cm.__exit__(None, None, None)
        self.iteration += 1
        r0 = time.perf_counter()
        report = self._det.generate_report_if_interval_elapsed()
        r1 = time.perf_counter()
        if report is not None and self.rank == 0:
            self.report_ms.append(1e3 * (r1 - r0))
            self._log(report, 1e3 * (r1 - r0))
        self._enter_step()
        self.costs.append(self._pending + time.thread_time() - c0)
        self._pending = 0.0

    def _log(self, report: Any, ms: float) -> None:
        flagged = report.identify_stragglers(THRESHOLD, THRESHOLD, THRESHOLD, THRESHOLD)
        rec = {
            "time": time.time(), "iteration": self.iteration, "report_ms": round(ms, 3),
            "relative": _scores(report.section_relative_perf_scores),
            "individual": _scores(report.section_individual_perf_scores),
            "flagged": {
                "relative": {s: sorted(i.rank for i in ids) for s, ids in
                             flagged["straggler_sections_relative"].items()},
                "individual": {s: sorted(i.rank for i in ids) for s, ids in
                               flagged["straggler_sections_individual"].items()},
            },
        }
        with open(self.run_dir / REPORTS, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def write_cost(self) -> None:
        us = [1e6 * c for c in self.costs[1:]] or [0.0]
        (self.run_dir / COST).write_text(json.dumps({
            "iterations": self.iteration, "step_cpu_us_median": statistics.median(us),
            "step_cpu_us_mean": statistics.fmean(us), "step_cpu_us_max": max(us),
            "reports": len(self.report_ms), "report_ms": [round(x, 3) for x in self.report_ms],
            "report_s": self.report_s, "threshold": THRESHOLD, "note": CPU_NOTE,
        }) + "\n")


def _scores(by_section: Any) -> dict[str, dict[str, float]]:
    return {s: {str(r): round(float(v), 4) for r, v in ranks.items()}
            for s, ranks in by_section.items()}


def install_from_env() -> Harness | None:
    """Attach the detector to this rank when the bench asked for it (``ENV`` set); the run
    directory is ``STALWART_RUN_DIR`` (set by stalwart's launcher)."""
    if not os.environ.get(ENV):
        return None
    h = Harness(Path(os.environ["STALWART_RUN_DIR"]), int(os.environ.get("RANK", "0")))
    h.install()
    return h


def main() -> None:
    """``python -m stalwart.bench.peers.nvrx --config CFG``: stalwart's own training worker
    (the built-in GPT) with the detector attached -- how the bench puts it into the same
    runs as stalwart's monitor."""
    from stalwart.train import worker

    install_from_env()
    sys.exit(worker.main())


if __name__ == "__main__":
    main()
