"""Model size presets: one name -> (model shape, micro-batch size per rank, learning rate).

Torch-free, so that the configuration and the command line can name and check presets
without importing torch; ``stalwart.train.model.GPT`` builds the model from a ``GPTConfig``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 64  # context length
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# name -> (model shape, micro-batch size per rank, default learning rate)
PRESETS: dict[str, dict] = {
    # fits a 2-core CPU running 4 ranks: a few minutes for a few hundred steps
    "tiny": {"model": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64), "batch_size": 8,
             "lr": 3e-3},
    "small": {"model": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
              "batch_size": 16, "lr": 1e-3},
    # for real hardware (a GPU per rank)
    "medium": {"model": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
               "batch_size": 32, "lr": 6e-4},
    "gpt2": {"model": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
             "batch_size": 8, "lr": 6e-4},
}


def n_params(cfg: GPTConfig) -> int:
    """The GPT's parameter count (head tied to the token embedding), without building it."""
    e = cfg.n_embd
    block = 2 * 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (4 * e * e + 4 * e) + (4 * e * e + e)
    return cfg.vocab_size * e + cfg.block_size * e + cfg.n_layer * block + 2 * e
