"""Named models for `hetrain plan --model NAME`."""
from __future__ import annotations

from typing import Callable

from ..errors import UserError
from .chain import ChainModel


def _ctr(**kw) -> ChainModel:
    from .ctr import CTRModel
    return CTRModel(**kw)


def _cnn(**kw) -> ChainModel:
    from .cnn import CNNModel
    return CNNModel(**kw)


def _transformer(**kw) -> ChainModel:
    from .transformer import TransformerModel
    return TransformerModel(**kw)


def _transformer200(**kw) -> ChainModel:
    from .transformer import TransformerModel
    return TransformerModel(**{"depth": 99, "d": 128, "seq": 32, **kw})


ZOO: dict[str, tuple[Callable[..., ChainModel], str]] = {
    "ctr": (_ctr, "DLRM-like CTR model: 26 Criteo-size embedding tables (33.8M rows x 64), MLPs"),
    "cnn": (_cnn, "ResNet-style CNN for 32x32 images, 8 layers"),
    "transformer": (_transformer, "transformer encoder, d=256, 6 blocks (14 layers)"),
    "transformer200": (_transformer200, "transformer encoder, d=128, 99 blocks (200 layers)"),
}


def build_model(name: str, **kwargs) -> ChainModel:
    if name not in ZOO:
        raise UserError(f"unknown model {name!r}; built-in models: {sorted(ZOO)} "
                        "(or pass a profile .json file)")
    return ZOO[name][0](**kwargs)
