"""The base of every event type: a kind's name and its JSON line's fields. Torch-free, no I/O."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass
class Event:
    """One line of ``events.jsonl``: ``name`` is its "event" key, the dataclass fields (in
    their declared order) its content; a field named in ``optional`` is left out of the
    line when it is None."""

    name: ClassVar[str] = ""

    def fields(self) -> dict[str, Any]:
        """The JSON line's fields (an optional field that is None is left out)."""
        d = asdict(self)
        for k in self.optional:
            if d.get(k) is None:
                d.pop(k, None)
        return d

    optional: ClassVar[tuple[str, ...]] = ()
