"""The reference workload's data: a byte-level corpus and a deterministic batch sampler.

Default corpus: the running interpreter's own standard library (.py files) -- real text that is
present on every machine, so the default job needs no download. Files are gathered in sorted
order and split into train/validation by a stable hash of their path relative to the library
root, so every rank and every machine with the same Python sees the same split.

Batches are a pure function of (seed, step, global micro-batch index): the step's global batch
is one fixed draw of ``global_batch`` windows, cut into identical micro-batches, and a plan only
says which rank computes which micro-batch indices. So every sample is used exactly once per
step whatever the plan or the world size (mitigation moves micro-batches between ranks and
restarts at N-1 ranks without changing the training), the "data position" of a checkpoint is
just the step counter, and a resumed run reads exactly the batches an uninterrupted run would
have read.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VAL_PERCENT = 5  # share of files (by path hash) held out for validation
DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # cap so start-up stays ~1 s on a small machine


class DataError(ValueError):
    """A corpus that cannot be used (missing path, empty, unreadable)."""


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes
    val: np.ndarray
    source: str

    def describe(self) -> str:
        return f"{self.source}: {len(self.train):,} train bytes, {len(self.val):,} val bytes"


def _is_val(rel: str) -> bool:
    h = hashlib.sha256(rel.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(h[:4], "big") % 100 < VAL_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _gather(files: list[tuple[str, Path]], max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    train: list[bytes] = []
    val: list[bytes] = []
    n_train = n_val = 0
    cap_val = max(max_bytes * VAL_PERCENT // 100, 1)
    for rel, path in files:
        if n_train >= max_bytes and n_val >= cap_val:
            break
        is_val = _is_val(rel)
        if (is_val and n_val >= cap_val) or (not is_val and n_train >= max_bytes):
            continue
        try:
            blob = path.read_bytes()
        except OSError:
            continue  # unreadable file in the stdlib tree: skip, the corpus stays deterministic
        if is_val:
            val.append(blob)
            n_val += len(blob)
        else:
            train.append(blob)
            n_train += len(blob)
    def cat(parts: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(parts), dtype=np.uint8).copy()

    return cat(train), cat(val)


def load_corpus(data: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Load the default stdlib corpus (data=None), a text file, or a folder of text files."""
    if data is None:
        root = stdlib_root()
        files = sorted(
            (str(p.relative_to(root)), p)
            for p in root.rglob("*.py")
            if "site-packages" not in p.parts and "dist-packages" not in p.parts
        )
        source = f"python stdlib ({root})"
    else:
        path = Path(data)
        if not path.exists():
            raise DataError(f"data path does not exist: {data}")
        if path.is_file():
            try:
                blob = path.read_bytes()
            except OSError as e:
                raise DataError(f"cannot read data file {data}: {e.strerror}") from None
            if len(blob) < 1024:
                raise DataError(f"data file too small (need >= 1024 bytes): {data}")
            # a single file: the last VAL_PERCENT of its bytes is the validation split
            cut = len(blob) * (100 - VAL_PERCENT) // 100
            arr = np.frombuffer(blob, dtype=np.uint8)
            return Corpus(arr[:cut][:max_bytes].copy(), arr[cut:].copy(), f"file {data}")
        files = sorted(
            (str(p.relative_to(path)), p) for p in path.rglob("*") if p.is_file()
        )
        source = f"folder {data}"
    train, val = _gather(files, max_bytes)
    if len(train) < 1024 or len(val) < 256:
        raise DataError(f"corpus too small after the train/validation split: {data or 'stdlib'}")
    return Corpus(train, val, source)


def sample_batch(
    split: np.ndarray, batch_size: int, block_size: int, seed: int, *key: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `split`, a pure function of (seed, *key).

    Returns (x, y) int64 tensors of shape (batch_size, block_size), y shifted by one byte.
    """
    rng = np.random.default_rng([seed, *key])
    starts = rng.integers(0, len(split) - block_size - 1, size=batch_size)
    idx = starts[:, None] + np.arange(block_size + 1)[None, :]
    chunk = torch.from_numpy(split[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


def train_batch(
    corpus: Corpus, batch_size: int, block_size: int, seed: int, step: int, rank: int,
    micro: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_batch(corpus.train, batch_size, block_size, seed, 0, step, rank, micro)


def step_starts(corpus: Corpus, global_batch: int, block_size: int, seed: int, step: int
                ) -> np.ndarray:
    """Start offsets of the step's whole global batch (a pure function of seed and step)."""
    rng = np.random.default_rng([seed, 2, step])
    return rng.integers(0, len(corpus.train) - block_size - 1, size=global_batch)


def micro_batch(corpus: Corpus, starts: np.ndarray, micro_size: int, block_size: int,
                index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``index`` of a step: samples [index*size, (index+1)*size)."""
    s = starts[index * micro_size:(index + 1) * micro_size]
    if len(s) != micro_size:
        raise IndexError(f"micro-batch {index} is outside the step's global batch")
    idx = s[:, None] + np.arange(block_size + 1)[None, :]
    chunk = torch.from_numpy(corpus.train[idx].astype(np.int64))
    return chunk[:, :-1], chunk[:, 1:]


def val_batches(
    corpus: Corpus, n: int, batch_size: int, block_size: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: the same n batches at every evaluation and on every rank."""
    return [sample_batch(corpus.val, batch_size, block_size, seed, 1, i) for i in range(n)]
