"""The report's plots leave the user's matplotlib alone: importing and running them does not
switch the pyplot backend (it used to call ``matplotlib.use("Agg")`` at import) nor leave
pyplot figures open. Run in a fresh interpreter, where the backend is still unset."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path
import matplotlib
matplotlib.use("svg")                      # the user's choice, made before importing us
from stalwart.report.plots import all_plots
from tests.report.synth import MITIGATED_EVENTS, MITIGATED_PLANS, write_run
from stalwart.rundir import RunData
run_dir = write_run(Path(sys.argv[1]) / "run", MITIGATED_PLANS, MITIGATED_EVENTS,
                    slow=(2, 30, 90))
made = all_plots(RunData.load(run_dir), run_dir)
import matplotlib.pyplot as plt
print(matplotlib.get_backend(), len(made), len(plt.get_fignums()))
"""


def test_plots_keep_the_users_backend_and_open_no_pyplot_figure(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    backend, made, open_figs = out.stdout.split()
    assert backend == "svg"
    assert int(made) >= 4 and int(open_figs) == 0
    assert all(p.stat().st_size > 0 for p in (tmp_path / "run").glob("*.png"))
