"""Python objects as bytes for `broadcast_object`, without pickle on the receiving side.

An object is encoded with `torch.save` and decoded with `torch.load(weights_only=True)`,
PyTorch's restricted loader: it rebuilds tensors, numbers, strings and the containers
below, and refuses any other class, so bytes from the network never run code. Before
encoding, the sender checks that the object holds only these types, so a script that
broadcasts something else gets a clear `UserError` on its own rank (and, through
`broadcast_object`, on every rank) rather than a loader error on the others.

Allowed: None, bool, int, float, complex, str, bytes, torch.Tensor (dense), torch.Size,
torch.dtype, torch.device, and list, tuple, dict, collections.OrderedDict, set, frozenset
of allowed values (dict keys too). Tensors come back on the CPU.
"""
from __future__ import annotations

import collections
import io

import torch

from .errors import UserError

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_CONTAINERS = (list, tuple, dict, collections.OrderedDict, set, frozenset)
MAX_DEPTH = 100


def check_object(obj, where: str = "obj", depth: int = 0) -> None:
    """Raise UserError naming the first value (by its path in `obj`) that is not allowed."""
    if depth > MAX_DEPTH:
        raise UserError(f"broadcast_object: {where} is nested more than {MAX_DEPTH} levels deep")
    kind = type(obj)
    if kind in _SCALARS:
        return
    if isinstance(obj, torch.Tensor):
        if kind is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise UserError(f"broadcast_object: {where} is a {kind.__name__} (a tensor subclass); pass a plain "
                            "tensor (.detach())")
        if obj.layout != torch.strided:
            raise UserError(f"broadcast_object: {where} is a {obj.layout} tensor; pass a dense one (.to_dense())")
        return
    if kind in (dict, collections.OrderedDict):
        for k, v in obj.items():
            check_object(k, f"a key of {where}", depth + 1)
            check_object(v, f"{where}[{k!r}]", depth + 1)
        return
    if kind in _CONTAINERS:
        for i, v in enumerate(obj):
            check_object(v, f"{where}[{i}]", depth + 1)
        return
    hint = " (convert numpy arrays with torch.from_numpy)" if kind.__module__ == "numpy" else ""
    raise UserError(f"broadcast_object: {where} is a {kind.__module__}.{kind.__qualname__}, which hetrain does not "
                    f"send: nothing received from the network is unpickled, so only tensors, numbers, strings, "
                    f"bytes, None and list/tuple/dict/set of them can be broadcast{hint}")


def _plain(obj):
    """Parameters become plain tensors (the restricted loader rebuilds those)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    kind = type(obj)
    if kind in (dict, collections.OrderedDict):
        return kind((_plain(k), _plain(v)) for k, v in obj.items())
    if kind in (list, tuple, set, frozenset):
        return kind(_plain(v) for v in obj)
    return obj


def encode(obj) -> bytes:
    check_object(obj)
    buf = io.BytesIO()
    torch.save(_plain(obj), buf)
    return buf.getvalue()


def decode(data: bytes):
    """Bytes from `encode` (possibly from another machine) back into the object."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # the restricted loader refused something: never retry unrestricted
        raise UserError(f"broadcast_object: the bytes received could not be decoded safely ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); every rank must run the same hetrain "
                        "and PyTorch") from None
