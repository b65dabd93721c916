"""Which receive engine the lossy transport runs: the native data plane, or the Python one.

Mechanism: one transport, two engines behind the same interface (``receiving.Receiver``).
The native engine (``_native/engine.c``, built by ``pip install`` as
``stalwart.comm._stwnative``) runs the per-datagram work -- recvmmsg/GRO, header and bounds
checks, the AES-GCM tag (OpenSSL), placement, loss bookkeeping per (round, phase),
Reed-Solomon decoding (ISA-L) and the owner's sum -- on a thread that never takes the GIL, and
seals outgoing packets with the GIL released; Python runs per phase. The Python engine is the
reference: the same rules in numpy, tested against the native one by running the comm test
suite with each (``STALWART_ENGINE``).

Why not an existing library: the transport's contract is not a byte stream or a message queue
but "place this authenticated chunk of round r, phase p, shard s into the caller's buffer,
count what is missing per (round, phase) against the sender's end marker, rebuild stripes from
Reed-Solomon parity, and never wait for a retransmission". Reliable transports (TCP, QUIC
stacks such as quiche/msquic, libfabric's reliable endpoints, gloo, UCX) retransmit -- which is
what stalls under loss; unreliable datagram libraries (ENet's unsequenced channels, raw DPDK)
deliver packets but leave parsing, authentication, placement and loss accounting per packet to
the caller, which in Python is the cost being removed. OptiReduce, the closest system,
implements its bounded-time transport inside gloo on DPDK, without erasure coding or packet
authentication, and is not a library one can link. So the hot path is ours, in C, with
OpenSSL for the tag and ISA-L for the code.

Selection: ``STALWART_ENGINE=native|python``; by default native when the extension is built,
else Python with one line on stderr saying why (a machine without a compiler still runs).
"""

from __future__ import annotations

import importlib.util
import sys

from stalwart import envknobs

try:
    from stalwart.comm import _stwnative  # type: ignore[attr-defined]

    _WHY = ""
except ImportError as e:  # not built: no compiler or no OpenSSL headers at install time
    _stwnative = None
    _WHY = (str(e) if importlib.util.find_spec("stalwart.comm._stwnative") is not None else
            "no compiler or OpenSSL headers when it was installed; reinstall with gcc and "
            "libssl-dev for it")

ENGINES = ("native", "python")
AVAILABLE = _stwnative is not None
_warned = False


def engine_name(requested: str | None = None, warn: bool = True) -> str:
    """The engine to use: ``requested``, else ``STALWART_ENGINE``, else native when built
    (else Python, saying so once per process when ``warn``)."""
    global _warned
    name = requested or envknobs.engine()
    if name and name not in ENGINES:
        raise ValueError(f"unknown STALWART_ENGINE {name!r} (native, python)")
    if name == "native" and not AVAILABLE:
        raise ValueError(f"STALWART_ENGINE=native but the native engine is not built: {_WHY}")
    if name:
        return name
    if AVAILABLE:
        return "native"
    if warn and not _warned:
        _warned = True
        print(f"stalwart.comm: native data plane not built ({_WHY}); using the Python engine",
              file=sys.stderr)
    return "python"


def module():
    """The extension module (only when ``AVAILABLE``); ISA-L is loaded into it once."""
    assert _stwnative is not None
    from stalwart.comm import fec

    if fec.ISAL_PATH and not _stwnative.has_isal():
        _stwnative.load_isal(fec.ISAL_PATH)
    return _stwnative
