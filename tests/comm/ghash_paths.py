"""The native engine's tag GHASHs a test can ask for (``STALWART_GHASH``) and the one
``ghash_path`` in engine.c then runs on this CPU."""

from __future__ import annotations

import pytest

# "default": the variable unset
GHASHES = ["default", "vpclmulqdq512", "vpclmulqdq", "openssl"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return set()
    return set(flags)


def expected_ghash(asked: str) -> str:
    """The GHASH the engine runs for ``STALWART_GHASH=asked`` on this CPU: the widest the CPU
    has unless forced narrower, never one it lacks (the 512-bit one needs AVX-512F/VL/BW and
    VPCLMULQDQ, the 256-bit one AVX2 and VPCLMULQDQ, both AES-NI and PCLMULQDQ)."""
    flags = _cpu_flags()
    has256 = {"aes", "pclmulqdq", "avx2", "vpclmulqdq"} <= flags
    has512 = has256 and {"avx512f", "avx512vl", "avx512bw"} <= flags
    if asked == "openssl" or not has256:
        return "openssl"
    if asked == "vpclmulqdq" or not has512:
        return "vpclmulqdq"
    return "vpclmulqdq512"


def use_ghash(asked: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines made after this call use ``asked`` (read by ``mac_new`` per engine)."""
    if asked == "default":
        monkeypatch.delenv("STALWART_GHASH", raising=False)
    else:
        monkeypatch.setenv("STALWART_GHASH", asked)
