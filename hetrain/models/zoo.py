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


def _small(build: Callable[..., ChainModel], **small) -> Callable[..., ChainModel]:
    return lambda **kw: build(**{**small, **kw})


ZOO: dict[str, tuple[Callable[..., ChainModel], str]] = {
    "ctr": (_ctr, "DLRM-like CTR model: 26 Criteo-size embedding tables (33.8M rows x 64), MLPs"),
    "cnn": (_cnn, "ResNet-style CNN for 32x32 images, 8 layers"),
    "transformer": (_transformer, "transformer encoder, d=256, 6 blocks (14 layers)"),
    "transformer200": (_transformer200, "transformer encoder, d=128, 99 blocks (200 layers)"),
    # small versions that train in seconds on a laptop (whole-job planning benchmarks, tests)
    "ctr-small": (_small(_ctr, table_rows=(2000,) * 8, dim=16, bottom=(64, 16), top=(64, 32), sparse_grad=False),
                  "CTR model with 8 tables of 2000 rows x 16, dense gradients"),
    "cnn-small": (_small(_cnn, widths=(16, 32, 64), blocks=1, image=16), "the CNN at widths 16-32-64, 16x16 images"),
    "transformer-small": (_small(_transformer, vocab=2000, d=64, depth=2, seq=16),
                          "transformer encoder, d=64, 2 blocks, 2000-token vocabulary"),
}


def build_model(name: str, **kwargs) -> ChainModel:
    if name not in ZOO:
        raise UserError(f"unknown model {name!r}; built-in models: {sorted(ZOO)} "
                        "(or pass a profile .json file)")
    return ZOO[name][0](**kwargs)
