"""The README's figures are the current record's (issue 38 item 5): every figure the capability
table quotes is in docs/BENCHMARKS.md, every MISSED figure there is quoted in the README's row
for its suite, and the record stays short.

The rules, on the text alone (no run is repeated):
- A number is digits with an optional decimal part and exponent (``0.824``, ``1.09e-3``,
  ``4,088``); thousands commas are dropped and so is a sign, so ``-0.19`` and ``+1.13%`` read
  ``0.19`` and ``1.13``. Numbers compare as written: ``0.50`` is not ``0.5``, ``135`` is not
  ``135.4``.
- A figure the README quotes is a number in the capability table's "latest measurement" column
  that has a decimal point or an exponent, or is followed by a unit (%, x, s, ms, us, h, mbit);
  counts without a unit ("5 false positives") and dates are not checked.
- A MISSED row is a row of a record table with a ``status`` column that reads MISSED; its values
  are the first number of each value column (the columns between ``figure`` and ``target...``,
  less those headed ``peer:`` or ``base``). Each must be a number of the README row of the
  suite the table sits under (its ``##`` heading); the GPU section's, of the GPUs paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
RECORD = (ROOT / "docs" / "BENCHMARKS.md").read_text()
MAX_LINES = 450

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?"
NUMBER = re.compile(_NUM)
# a number standing alone (not the tail of a name such as loss1 or r2), with what follows it
QUOTED = re.compile(r"(?<![\w.])[-+]?(" + _NUM + r")(\s?(?:%|x\b|s\b|ms\b|us\b|h\b|mbit\b))?")
# a record section's first word -> the start of its README row (None: the GPUs paragraph)
ROWS = {"detect": "| detect", "mitigate": "| mitigate", "overlap": "| overlap",
        "lossy": "| lossy comm", "testbed": "| testbed", "elastic": "| elastic",
        "simulation": "| simulate", "gpu": None}


def norm(token: str) -> str:
    return token.replace(",", "")


def numbers(text: str) -> set[str]:
    return {norm(m.group(0)) for m in NUMBER.finditer(text)}


def capability_rows() -> dict[str, str]:
    """The capability table's rows: first cell -> the "latest measurement" cell."""
    lines = README.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| capability |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    col = next(i for i, c in enumerate(head) if c.startswith("latest measurement"))
    rows = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[ln] = cells[col]
    return rows


def quoted(cell: str) -> list[str]:
    """The figures a README cell quotes (the module docstring's rule)."""
    out = []
    for m in QUOTED.finditer(cell):
        num, unit = m.group(1), m.group(2)
        if "." in num or "e" in num or unit:
            out.append(norm(num))
    return out


def readme_text_for(section: str) -> str:
    key = ROWS.get(section.split()[0].strip(":").lower(), "")
    if key is None:
        return next(p for p in README.split("\n\n") if p.startswith("**GPUs**"))
    row = next((ln for ln in README.split("\n") if key and ln.startswith(key)), None)
    return row if row is not None else README


def missed_rows() -> list[tuple[str, str, list[str]]]:
    """(section, figure cell, values) of every MISSED row in the record's tables."""
    out: list[tuple[str, str, list[str]]] = []
    section, head = "", None
    for ln in RECORD.split("\n"):
        if ln.startswith("## "):
            section, head = ln[3:], None
        if not ln.startswith("|"):
            head = None
            continue
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if head is None:
            head = cells
            continue
        if set(ln) <= set("|-: "):
            continue
        target = next((i for i, c in enumerate(head) if c.startswith("target")), None)
        if "status" not in head or target is None:
            continue
        if "MISSED" not in cells[head.index("status")]:
            continue
        values = []
        for i in range(1, target):
            if head[i].startswith(("peer", "base")):
                continue
            first = NUMBER.search(cells[i])
            if first:
                values.append(norm(first.group(0)))
        out.append((section, cells[0], values))
    return out


def test_the_record_is_short() -> None:
    n = len(RECORD.split("\n"))
    assert n <= MAX_LINES, f"docs/BENCHMARKS.md has {n} lines (at most {MAX_LINES}): move " \
        "superseded runs to docs/benchmarks/history/"


def test_the_rules_find_what_they_check() -> None:
    rows = capability_rows()
    assert any(k.startswith("| detect") for k in rows) and len(rows) >= 7
    assert sum(len(quoted(c)) for c in rows.values()) >= 40
    sections = {s.split()[0] for s, _, _ in missed_rows()}
    assert {"detect", "mitigate", "lossy", "overlap", "elastic", "GPU:"} <= sections
    assert quoted("0.8 of them, 135.4 us (60), 5 false, 1.09e-3, -2.4%, loss1 at 2x") == \
        ["0.8", "135.4", "1.09e-3", "2.4", "2"]


def test_every_readme_figure_is_in_the_record() -> None:
    held = numbers(RECORD)
    stray = [(row.split("|")[1].strip()[:30], n) for row, cell in capability_rows().items()
             for n in quoted(cell) if n not in held]
    assert not stray, f"README figures not in docs/BENCHMARKS.md: {stray}"


def test_every_missed_figure_is_in_the_readme() -> None:
    dropped = []
    for section, figure, values in missed_rows():
        have = numbers(readme_text_for(section))
        dropped += [(section.split()[0], figure[:50], v) for v in values if v not in have]
    assert not dropped, f"MISSED figures the README's row does not quote: {dropped}"
