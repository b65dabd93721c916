"""Coverage-guided fuzzing of the native engine's receive path (parser, checks, placement,
parity decoding), with atheris' libFuzzer.

Each input is a sequence of records; a record is one datagram fed to ``Engine.feed`` as if it
had arrived from a peer (or from an unknown address), raw or built from a valid packet whose
fields and payload the fuzzer chooses and which is then sealed with the job's key (random bytes
almost never carry a valid tag, and everything after the tag check would go unexplored), or an
event between datagrams: the next round begins, a phase closes. After every input the round
buffers must hold finite values and counts within bounds; a crash, a sanitizer report or a
failed check is a finding.

By hand (a longer run)::

    python tests/comm/fuzz_native.py build /tmp/stwfuzz        # instrumented + ASan build
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \\
      ASAN_OPTIONS=detect_leaks=0 \\
      PYTHONMALLOC=malloc STW_FUZZ_SO=/tmp/stwfuzz/_stwnative.so \\
      python tests/comm/fuzz_native.py fuzz -max_total_time=600

``tests/comm/test_native_fuzz.py`` does the same for a few seconds (marked slow).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from stalwart.comm.layout import Layout
from stalwart.comm.rounds import ROUNDS_OPEN, RoundState
from stalwart.comm.wire import (
    FLAG_END,
    FLAG_PARITY,
    HEADER,
    HEADER_BYTES,
    OVERHEAD,
    PHASE_GRAD,
    PHASE_NORM,
    PHASE_VALUE,
    Wire,
)

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "src" / "stalwart" / "comm" / "_native"
KEY, JOB, WORLD, ME, CHUNK = bytes(range(32)), 7, 3, 0, 8
LAY = Layout(numel=203, world=WORLD, chunk=CHUNK)  # shards of 68, 68, 67: 9 chunks each


def build(out: Path, asan: bool = True) -> Path:
    """The extension with coverage hooks for libFuzzer (and AddressSanitizer): returns the
    shared object, named so that ``import _stwnative`` finds its init function."""
    out.mkdir(parents=True, exist_ok=True)
    so = out / "_stwnative.so"
    cmd = ["gcc", "-O1", "-g", "-shared", "-fPIC", "-fno-omit-frame-pointer",
           f"-I{sysconfig.get_paths()['include']}"]
    if asan:
        cmd.append("-fsanitize=address")
    obj = out / "engine.o"
    subprocess.run([*cmd, "-c", "-fsanitize-coverage=trace-pc,trace-cmp",
                    str(NATIVE / "engine.c"), "-o", str(obj)], check=True)
    cov = out / "fuzz_cov.o"
    subprocess.run([*cmd, "-c", str(NATIVE / "fuzz_cov.c"), "-o", str(cov)], check=True)
    subprocess.run([*cmd, str(obj), str(cov), "-o", str(so), "-lcrypto", "-lpthread"],
                   check=True)
    return so


def load(path: str | None):
    """The engine module: the instrumented build at ``path``, else the installed one."""
    if not path:
        from stalwart.comm import native

        return native.module()
    import importlib.util

    spec = importlib.util.spec_from_file_location("_stwnative", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from stalwart.comm import fec

    if fec.ISAL_PATH:
        mod.load_isal(fec.ISAL_PATH)
    return mod


def bind_rounds(eng, lay: Layout, me: int) -> list[RoundState]:  # noqa: ANN001 (the C type)
    """ROUNDS_OPEN fresh rounds bound to a native engine's slots and reset (round i in slot
    i), as the collective binds them."""
    rounds = [RoundState.new(lay, me, i, keep=True) for i in range(ROUNDS_OPEN)]
    for i, st in enumerate(rounds):
        eng.bind_round(i, st.acc.sum, st.acc.count, st.acc.seen, st.acc.contrib, st.vals,
                       st.vseen, st.norm, st.got, st.marker, st.gtag, st.vtag, st.recovered)
        eng.reset_round(i, i)
    return rounds


class Target:
    """One engine (rank ``ME`` of ``WORLD``, never started: datagrams come through ``feed``)
    and the Python-owned buffers it writes."""

    def __init__(self, mod, may_copy: bool = False) -> None:
        self.wires = [Wire(KEY, JOB, WORLD, s, LAY.shard_lens, CHUNK) for s in range(WORLD)]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.eng = mod.Engine(fd=self.sock.fileno(), key=self.wires[ME].job_key, job=JOB,
                              world=WORLD, me=ME, shard_lens=LAY.shard_lens, chunk=CHUNK,
                              slot=OVERHEAD + 4 * CHUNK, rounds_open=ROUNDS_OPEN,
                              may_copy=may_copy, batch=4, rx_segments=1)
        self.eng.set_peers([0x7F000001] * WORLD, [1000 + s for s in range(WORLD)])
        self.rounds = bind_rounds(self.eng, LAY, ME)
        self.heard, self.ever = np.zeros(WORLD), np.zeros(WORLD, bool)
        self.rejected = np.zeros(11, np.int64)
        self.lgot, self.lowed = np.zeros(WORLD), np.zeros(WORLD)
        self.eng.bind_shared(self.heard, self.ever, self.rejected, self.lgot, self.lowed)
        self.round = 0
        self.eng.set_round(0)

    def begin_round(self) -> None:
        self.round += 1
        r = self.round
        self.eng.lock()
        try:
            for k in range(ROUNDS_OPEN):
                st = self.rounds[(r + k) % ROUNDS_OPEN]
                if st.rnd != r + k:
                    st.reset(r + k)
                    self.eng.reset_round((r + k) % ROUNDS_OPEN, r + k)
            self.eng.set_round(r)
        finally:
            self.eng.unlock()

    def packet(self, b: bytes) -> bytes:
        """A packet built from fuzzer bytes: kind, header fields, payload; sealed validly."""
        b = b.ljust(12, b"\0")
        kind, rnd, off, length, fb, copies, sender, flags = struct.unpack("<BBHBBBBB", b[:9])
        sender %= WORLD
        phase = (PHASE_GRAD, PHASE_VALUE, PHASE_NORM, PHASE_GRAD, PHASE_VALUE)[kind % 5]
        shard = ME if phase == PHASE_GRAD else sender
        fl = (0, 0, 0, FLAG_END, FLAG_PARITY)[kind % 5] if flags < 200 else flags & 3
        n = length % (CHUNK + 2)
        pay = np.frombuffer(b[12:].ljust(4 * n, b"\0")[: 4 * n], np.float32)
        if kind % 5 in (0, 1) and length < 128:  # mostly well-formed data: whole chunks
            off = (off % 10) * CHUNK
            n = max(0, min(CHUNK, LAY.shard_len(shard) - off))
            pay = np.resize(pay if pay.size else np.ones(1, np.float32), n).astype(np.float32)
        if fl == FLAG_PARITY:
            pay = np.resize(pay if pay.size else np.ones(1, np.float32), CHUNK)
            fb, copies, off = fb % 5 + 1, copies % 6 + 1, off % 32
        return self.wires[sender].packet(phase, self.round + rnd % 5 - 1, shard, off, pay,
                                         flags=fl, fb=fb if fl else 0xFFFF, copies=copies,
                                         length=None if fl != FLAG_END else length)

    def run(self, data: bytes) -> None:
        i = 0
        while i + 3 <= len(data):
            op, n = data[i], int.from_bytes(data[i + 1: i + 3], "little") % 200
            body = data[i + 3: i + 3 + n]
            i += 3 + n
            src = op & 3 if op & 3 < WORLD else -1
            if op & 0x10:
                self.begin_round()
                continue
            if op & 0x08:
                self.eng.lock()
                self.eng.close_phase(self.round % ROUNDS_OPEN, (body[:1] or b"\0")[0] % 3)
                self.eng.unlock()
                continue
            pkt = self.packet(body) if op & 0x20 else bytes(body)
            if op & 0x40 and len(pkt) >= HEADER_BYTES:  # a valid tag on mutated bytes
                row = np.zeros((1, max(len(pkt), OVERHEAD)), np.uint8)
                row[0, :len(pkt)] = np.frombuffer(pkt, np.uint8)
                hdr = row[0, :HEADER_BYTES].view(HEADER)[0]
                ln = int(hdr["length"])
                if OVERHEAD + 4 * ln == len(pkt) and int(hdr["sender"]) < WORLD:
                    self.wires[int(hdr["sender"])].seal_rows(row, np.array([ln]))
                    pkt = row[0].tobytes()
            self.eng.feed(pkt, src)
        self.check()

    def check(self) -> None:
        for st in self.rounds:
            assert np.isfinite(st.acc.sum).all() and np.isfinite(st.vals).all()
            assert (st.acc.count <= WORLD).all() and (st.acc.count >= 0).all()
            assert (st.got >= 0).all() and (st.got[:2] <= 9).all() and (st.got[2] <= 1).all()
        assert (self.rejected >= 0).all()


def seeds(t: Target) -> list[bytes]:
    """Valid sequences: a whole phase from one peer, with parity, a marker, a norm."""
    out = []
    for kind in range(5):
        body = bytes([kind, 1, 0, 8, 2, 2, 1, 0]) + b"\0" * 4 + np.arange(8, dtype="<f4").tobytes()
        out.append(bytes([0x21, len(body), 0]) + body)
    seq = b""
    for c in range(9):
        body = bytes([0, 1, c, 0, 0, 0, 1, 0]) + b"\0" * 4 + np.full(8, c, "<f4").tobytes()
        seq += bytes([0x21, len(body), 0]) + body
    out.append(seq + bytes([0x10, 0, 0]) + out[0])
    return out


def fuzz(argv: list[str]) -> None:
    sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)  # libFuzzer's hooks for the build
    import atheris

    so = os.environ.get("STW_FUZZ_SO")
    mod = load(so)
    state = {"t": Target(mod), "n": 0}

    def one(data: bytes) -> None:
        state["n"] += 1
        if state["n"] % 500 == 0:  # a fresh engine now and then: state must not pile up
            state["t"] = Target(mod, may_copy=bool(state["n"] % 1000))
        state["t"].run(data)

    corpus = Path(tempfile.mkdtemp(prefix="stwfuzz-corpus-"))
    for i, s in enumerate(seeds(state["t"])):
        (corpus / f"seed{i}").write_bytes(s)
    atheris.Setup([argv[0], *argv[1:], str(corpus)], one)
    if so:  # hand the build's counters to libFuzzer: atheris' copy, found by its own handle
        import ctypes
        import glob

        core = glob.glob(os.path.join(os.path.dirname(atheris.__file__),
                                      "core_with_libfuzzer*.so"))[0]
        init = ctypes.CDLL(core)["__sanitizer_cov_8bit_counters_init"]
        ctypes.CDLL(so).stw_fuzz_register(ctypes.cast(init, ctypes.c_void_p))
    atheris.Fuzz()


def traffic() -> None:
    """The build at ``STW_FUZZ_SO`` as the collective's engine, its receive thread on real
    sockets: all-reduces of 3 ranks, with packets dropped in bursts (parity rebuilds them)."""
    sys.modules["stalwart.comm._stwnative"] = load(os.environ["STW_FUZZ_SO"])
    sys.path.insert(0, str(Path(__file__).parent))
    from inproc import Dropping, make_group, run_threads

    group = make_group(3, 50_000, cls=Dropping, fec_mode="rs", cap=2.0, engine="native")
    try:
        for c in group:
            c.set_drop(50, 8)
        for it in range(3):
            xs = [np.full(50_000, float(r + it), np.float32) for r in range(3)]
            outs = run_threads([lambda c=c, x=x: c.allreduce(x)
                                for c, x in zip(group, xs, strict=True)])
            for o in outs:
                assert not isinstance(o, BaseException), o
                np.testing.assert_allclose(o[0], sum(xs) / 3, rtol=1e-6)
        print("traffic ok:", sum(c.dropped for c in group), "datagrams dropped and rebuilt")
    finally:
        for c in group:
            c.close()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "build":
        print(build(Path(sys.argv[2])))
    elif len(sys.argv) >= 2 and sys.argv[1] == "fuzz":
        fuzz([sys.argv[0], *sys.argv[2:]])
    elif len(sys.argv) >= 2 and sys.argv[1] == "traffic":
        traffic()
    else:
        sys.exit("usage: fuzz_native.py build DIR | fuzz [libFuzzer options] | traffic")
