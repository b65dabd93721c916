"""Build of the native parts (the data plane ``stalwart.comm._stwnative``, the detector's
BOCPD step ``stalwart.detect._bocpd`` and its per-rank channels' step
``stalwart.detect._channels``, the heartbeat's sender ``stalwart._beat``); everything else
is in pyproject.toml. All four extensions
are optional: without a compiler (or OpenSSL's headers) the install still succeeds and the
Python reference runs instead (``stalwart.comm`` says so in one line)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stalwart.comm._stwnative",
            sources=["src/stalwart/comm/_native/engine.c"],
            libraries=["crypto", "pthread"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "stalwart.detect._bocpd",
            sources=["src/stalwart/detect/_native/bocpd.c"],
            depends=["src/stalwart/detect/_native/bocpd_step.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "stalwart.detect._channels",
            sources=["src/stalwart/detect/_native/channels.c"],
            depends=["src/stalwart/detect/_native/bocpd_step.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "stalwart._beat",
            sources=["src/stalwart/_native/beat.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
            libraries=["pthread"],
            optional=True,
        ),
    ]
)
