"""Run directory -> report.html with PNG plots (``stalwart report DIR``)."""

from stalwart.report.html import build_report

__all__ = ["build_report"]
