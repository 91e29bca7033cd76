"""Model zoo for placement and the HeterPS runtime: real torch models built as chains.

Every model is a `ChainModel`: an ordered list of layers, each mapping a tuple of
tensors to a tuple of tensors, so a cut between any two layers is a well-defined
pipeline boundary (the tensors that cross it are the activations sent on).

    from hetrain.models import build_model, ZOO
    model = build_model("ctr")                  # DLRM-like CTR model
    x = model.example_inputs(batch=32)
    logit = model(*x)                           # (32, 1)
    model.layer_list()                          # [(name, module, kind), ...]
"""
from .chain import ChainLayer, ChainModel
from .zoo import ZOO, build_model

__all__ = ["ChainLayer", "ChainModel", "ZOO", "build_model"]
