"""``stalwart replay --trace FILE``: a past job's trace through the verdict (CLI glue).

Reads the trace (``read``), the layout from ``--layout``/``--rank-order``/``--ranks-per-host``
or a sidecar (``FILE.layout.json``, or ``layout.json`` in a trace directory; the command
line wins), the op-name rules (``--map`` first, then the sidecar's ``map``, then the
defaults), decides (``verdict.decide``), prints the verdict and writes it as JSON
(``--json``). Without a layout: every traced rank is a data-parallel replica (dp = highest
rank + 1). Bad input: ``ConfigError`` (one line naming the value, exit 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError
from stalwart.traces.layout import Layout, parse_order
from stalwart.traces.opnames import OpMap, parse_rule
from stalwart.traces.read import read_sidecar, read_trace, sidecar_path
from stalwart.traces.verdict import Verdict, decide


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a past job's trace (instead of RUN_DIRs; docs/detect.md, "
                             "'Traces from a past job')")
    g.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="CSV or parquet (rank,step,name,start,duration[,micro]), Kineto "
                        "JSON, or a directory of them (one per rank)")
    g.add_argument("--layout", default=None, metavar="dp=D,pp=P,tp=T",
                   help="the job's parallel layout (default: a sidecar FILE.layout.json, "
                        "else pure data parallel)")
    g.add_argument("--rank-order", default=None, metavar="tp-dp-pp",
                   help="rank numbering, fastest-varying dimension first (default tp-dp-pp, "
                        "Megatron-LM's)")
    g.add_argument("--ranks-per-host", type=int, default=None, metavar="N",
                   help="ranks r*N..r*N+N-1 share a host: a host whose ranks are all slow is "
                        "named as one")
    g.add_argument("--map", action="append", default=[], metavar="NAME=KIND",
                   help="operation name (* and ? allowed) to compute, comm, step or other; "
                        "before the defaults; repeatable")
    g.add_argument("--unit", default=None, choices=("s", "ms", "us", "ns"),
                   help="time unit of a CSV/parquet trace's start and duration (default s)")


def _layout(args: argparse.Namespace, side: dict[str, Any], max_rank: int) -> Layout:
    order = args.rank_order or side.get("order")
    rph = args.ranks_per_host if args.ranks_per_host is not None else side.get("ranks_per_host")
    if rph is not None and (not isinstance(rph, int) or rph < 1):
        raise ConfigError(f"--ranks-per-host {rph}: must be a whole number >= 1")
    if args.layout:
        return Layout.parse(args.layout, order, rph)
    if any(k in side for k in ("dp", "pp", "tp")):
        text = ",".join(f"{k}={side[k]}" for k in ("dp", "pp", "tp") if k in side)
        return Layout.parse(text, order, rph)
    return Layout(dp=max_rank + 1, order=parse_order(order), ranks_per_host=rph)


def run(args: argparse.Namespace) -> Verdict:
    side: dict[str, Any] = {}
    sc = sidecar_path(args.trace) if args.trace.exists() else None
    if sc is not None and sc.is_file():
        side = read_sidecar(sc)
    smap = side.get("map") or {}
    if not isinstance(smap, dict):
        raise ConfigError(f"layout file {sc}: 'map' must be an object NAME -> KIND")
    rules = [parse_rule(r) for r in args.map] + [parse_rule(f"{k}={v}") for k, v in smap.items()]
    opmap = OpMap(rules)
    trace = read_trace(args.trace, args.unit or side.get("unit", "s"), opmap)
    layout = _layout(args, side, int(trace.rank.max()))
    return decide(trace, layout, opmap)


def summary(v: Verdict) -> list[str]:
    c = v.coverage
    lines = [f"trace {c['source']} ({c['format']}): {c['ranks_traced']} of {c['world']} ranks, "
             f"{c['steps']} steps {c['step_range']}, layout {c['layout']}",
             f"verdict: {v.verdict}"]
    for f in v.findings:
        who = (f"ranks {f.ranks}" if f.ranks else "no rank")
        where = (f" host {f.host}" if f.host is not None else
                 f" group dp={f.group['dp']},pp={f.group['pp']}" if f.group and f.kind ==
                 "slow_group" else f" stage {f.stage}" if f.kind == "stage_imbalance" else "")
        cost = ""
        if f.cost_fraction is not None:
            cost = f"; costs {100 * f.cost_fraction:.1f}% of a step"
            if f.cost_s_per_step is not None:
                cost += f" ({1e3 * f.cost_s_per_step:.3g} ms)"
        if f.from_step is not None:
            where += f" from step {f.from_step}"
        if f.to_step is not None:
            where += f" until step {f.to_step}"
        lines.append(f"  {f.kind}:{where} {who}, {f.factor:.2f}x{cost}")
        lines.append(f"    {f.confidence}")
        lines += [f"    note: {n}" for n in f.notes]
    if v.verdict == "undecided":
        lines.append("  no comparison possible: no traced worker has a peer at its stage and "
                     "one stage is traced (trace more ranks)")
    elif not v.findings:
        lines.append(f"  no slow worker, no imbalance; the smallest slowdown this trace could "
                     f"show: {c['smallest_detectable_slowdown']}x")
    lines.append(f"  input test: {c['input_test']}")
    r = v.rule
    lines.append(f"  rule: false-alarm rate {r['alpha_per_trace']} per trace over {r['tests']} "
                 f"tests (z >= {r['z_bound']} or sign test p <= {r['sign_p_bound']:.2g}), "
                 f"slowdowns >= {r['min_factor']}x, unit {r['unit']}")
    if c["unmapped_names"]:
        lines.append(f"  names counted as neither compute nor comm: "
                     f"{', '.join(c['unmapped_names'])} (--map NAME=KIND to change)")
    return lines


def main(args: argparse.Namespace) -> int:
    v = run(args)
    print("\n".join(summary(v)))
    if args.json:
        args.json.write_text(json.dumps(v.to_dict(), indent=2))
        print(f"verdict written to {args.json}")
    return 0
