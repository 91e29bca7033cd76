"""Gradient compression names (Horovod's and BytePS's `Compression`), mapped onto the
job's codec."""
from __future__ import annotations

from ..errors import UserError

class Compression:
    """Gradient compression names for `DistributedOptimizer(compression=...)`, as in
    Horovod and BytePS (`Compression.none`, `Compression.fp16`), plus hetrain's codecs.
    A codec is a job setting (`hetrain launch --codec`): the summation servers decode
    with it, so an optimizer may only ask for the codec the job runs."""

    none = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"
    auto = "auto"


# Horovod's and BytePS's compressor classes, by name
_FOREIGN_CODECS = {"NoneCompressor": "fp32", "FP16Compressor": "fp16"}


def _codec_name(compression) -> str:
    if isinstance(compression, str):
        name = {"none": "fp32"}.get(compression.lower(), compression.lower())
    else:
        label = getattr(compression, "__name__", type(compression).__name__)
        name = _FOREIGN_CODECS.get(label)
        if name is None:
            raise UserError(f"compression={compression!r} is not a codec hetrain knows; use hetrain.Compression.none, "
                            ".fp16, .int8, .int4 or .auto (or Horovod's/BytePS's Compression.none / .fp16)")
    from ..comm.compress import CODECS

    if name not in CODECS + ("auto",):
        raise UserError(f"compression={compression!r}: unknown codec {name!r}; choose one of "
                        f"{', '.join(CODECS + ('auto',))}")
    return name
