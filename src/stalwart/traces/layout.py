"""A job's DP x PP x TP layout and its rank numbering: which ranks are peers.

``Layout.parse("dp=2,pp=4,tp=8", order="tp-dp-pp")`` places rank r at (dp, pp, tp)
coordinates; ``order`` lists the dimensions fastest-varying first (Megatron-LM's and
torchtitan's default puts tp fastest, then dp, then pp: rank = tp + T*(dp + D*pp)).
Ranks at the same pipeline stage do the same work per micro-batch (the same layers, 1/T of
each); ranks with the same (dp, pp) form one tensor-parallel group, which steps as one worker.
Guarantees: pure; a bad string raises ``ConfigError`` naming it. Cost: O(1) per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.errors import ConfigError

DIMS = ("dp", "pp", "tp")
DEFAULT_ORDER = ("tp", "dp", "pp")


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int = 1
    tp: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    ranks_per_host: int | None = None

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank {rank} is outside the layout dp={self.dp},pp={self.pp},"
                              f"tp={self.tp} (world {self.world})")
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        out, r = {}, rank
        for d in self.order:
            out[d] = r % sizes[d]
            r //= sizes[d]
        return Coord(**out)

    def rank_of(self, c: Coord) -> int:
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        r, mult = 0, 1
        for d in self.order:
            r += getattr(c, d) * mult
            mult *= sizes[d]
        return r

    def host(self, rank: int) -> int | None:
        return None if self.ranks_per_host is None else rank // self.ranks_per_host

    def describe(self) -> str:
        s = f"dp={self.dp},pp={self.pp},tp={self.tp} (rank order {'-'.join(self.order)}"
        if self.ranks_per_host:
            s += f", {self.ranks_per_host} ranks per host"
        return s + ")"

    @staticmethod
    def parse(text: str, order: str | None = None,
              ranks_per_host: int | None = None) -> Layout:
        sizes = {"dp": 1, "pp": 1, "tp": 1}
        seen = set()
        for part in text.split(","):
            key, eq, val = part.strip().partition("=")
            key = key.strip().lower()
            if not eq or key not in sizes or key in seen:
                raise ConfigError(f"--layout {text!r}: expected dp=D,pp=P,tp=T (got {part!r})")
            try:
                n = int(val)
            except ValueError:
                raise ConfigError(f"--layout {text!r}: {key}={val!r} is not a whole "
                                  "number") from None
            if n < 1:
                raise ConfigError(f"--layout {text!r}: {key}={n} must be >= 1")
            sizes[key] = n
            seen.add(key)
        return Layout(**sizes, order=parse_order(order), ranks_per_host=ranks_per_host)


def parse_order(text: str | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_ORDER
    dims = tuple(d.strip().lower() for d in text.replace(",", "-").split("-"))
    if sorted(dims) != sorted(DIMS):
        raise ConfigError(f"--rank-order {text!r}: a permutation of tp-dp-pp, fastest-varying "
                          "first")
    return dims
