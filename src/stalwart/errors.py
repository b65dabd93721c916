"""The one error type for bad user input (the bottom layer: imports nothing of stalwart).

A ``ConfigError``'s message is one line that names the bad value; the CLI and the rank entry
points turn it into that line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input. The message is one line that names the bad value."""
