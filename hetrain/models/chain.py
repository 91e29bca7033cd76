"""Chain models: a sequence of layers over tuples of tensors."""
from __future__ import annotations

import torch
from torch import nn


class ChainLayer(nn.Module):
    """One placeable layer. ``kind`` is dense (compute-bound), memory (memory-bound)
    or sparse (embedding lookups); subclasses implement ``forward(*tensors) -> tuple``."""

    kind: str = "dense"


class ChainModel(nn.Module):
    """An ordered list of named `ChainLayer`s; ``forward`` runs them in order."""

    def __init__(self, layers: list[tuple[str, ChainLayer]]):
        super().__init__()
        if not layers:
            raise ValueError("a chain model needs at least one layer")
        self.names = [n for n, _ in layers]
        self.layers = nn.ModuleList([m for _, m in layers])

    def forward(self, *inputs: torch.Tensor):
        state = tuple(inputs)
        for layer in self.layers:
            state = layer(*state)
        return state[0] if len(state) == 1 else state

    def run_range(self, start: int, end: int, *state: torch.Tensor) -> tuple:
        """Run layers start..end-1 (one pipeline stage) on a state tuple."""
        for layer in self.layers[start:end]:
            state = layer(*state)
        return tuple(state)

    def layer_list(self) -> list[tuple[str, ChainLayer, str]]:
        return [(n, m, m.kind) for n, m in zip(self.names, self.layers)]

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
