"""Units of the reference workload: the GPT model, the corpus and the batch sampler."""

from __future__ import annotations

import math

import pytest
import torch

from stalwart.train.data import DataError, load_corpus, sample_batch, train_batch, val_batches
from stalwart.train.model import GPT, PRESETS, GPTConfig


def test_initial_loss_is_near_uniform_over_bytes() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, 256, (4, 32))
    y = torch.randint(0, 256, (4, 32))
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change only the future
    a, _ = model(x)
    b, _ = model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-6)


def test_weight_tying_and_presets() -> None:
    model = GPT(PRESETS["tiny"]["model"])
    assert model.head.weight is model.wte.weight
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_model_learns_a_repeated_pattern() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seq = torch.tensor([list(b"abcdefgh" * 3)[:17]] * 4)
    x, y = seq[:, :-1], seq[:, 1:]
    first = None
    for _ in range(60):
        _, loss = model(x, y)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def test_default_corpus_is_deterministic_stdlib_text() -> None:
    a = load_corpus(max_bytes=200_000)
    b = load_corpus(max_bytes=200_000)
    assert a.train.tobytes() == b.train.tobytes() and a.val.tobytes() == b.val.tobytes()
    assert len(a.train) >= 200_000 and len(a.val) > 0
    assert b"def " in a.train.tobytes()


def test_train_and_val_files_are_disjoint(tmp_path) -> None:
    for i in range(200):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 40)
    c = load_corpus(str(tmp_path))
    train, val = c.train.tobytes(), c.val.tobytes()
    for i in range(200):
        marker = f"file {i} file {i} ".encode()
        assert not (marker in train and marker in val)


def test_corpus_errors(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "missing"))
    small = tmp_path / "small.txt"
    small.write_text("hi")
    with pytest.raises(DataError, match="too small"):
        load_corpus(str(small))


def test_batches_are_pure_functions_of_their_key() -> None:
    c = load_corpus(max_bytes=100_000)
    x1, y1 = train_batch(c, 4, 32, seed=1, step=5, rank=2)
    x2, y2 = train_batch(c, 4, 32, seed=1, step=5, rank=2)
    x3, _ = train_batch(c, 4, 32, seed=1, step=5, rank=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one byte
    v1 = val_batches(c, 3, 4, 32, seed=1)
    v2 = val_batches(c, 3, 4, 32, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2, strict=True))
    xs, _ = sample_batch(c.val, 2, 8, 0, 9)
    assert xs.dtype == torch.int64 and xs.shape == (2, 8)
