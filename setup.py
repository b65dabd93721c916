"""Build of the native data plane (``stalwart.comm._stwnative``); everything else is in
pyproject.toml. The extension is optional: without a compiler (or OpenSSL's headers) the
install still succeeds and ``stalwart.comm`` runs its Python engine, saying so in one line."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stalwart.comm._stwnative",
            sources=["src/stalwart/comm/_native/engine.c"],
            libraries=["crypto", "pthread"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
