"""The elastic API's errors: each message is one line that names the call, value or store."""

from __future__ import annotations


class ElasticError(RuntimeError):
    """The job cannot go on (or this process cannot be part of it)."""


class UsageError(ElasticError):
    """A call out of order (the message names the call)."""


class Refused(ElasticError):
    """This process's code version or run configuration differs from the job's: it is not
    let in, and the job is not touched."""


class StoreLost(ElasticError):
    """The membership store cannot be reached any more."""
