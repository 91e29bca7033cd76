"""Gradient compression names (Horovod's and BytePS's `Compression`), mapped onto the
job's codec."""
from __future__ import annotations

from ..errors import UserError
from ..modes import CodecChoice


class Compression:
    """Gradient compression names for `DistributedOptimizer(compression=...)`, as in
    Horovod and BytePS (`Compression.none`, `Compression.fp16`), plus hetrain's codecs.
    A codec is a job setting (`hetrain launch --codec`): the summation servers decode
    with it, so an optimizer may only ask for the codec the job runs."""

    none = CodecChoice.FP32.value  # plain words, as the user wrote them in messages
    fp16 = CodecChoice.FP16.value
    int8 = CodecChoice.INT8.value
    int4 = CodecChoice.INT4.value
    auto = CodecChoice.AUTO.value


# Horovod's and BytePS's compressor classes, by name
_FOREIGN_CODECS = {"NoneCompressor": CodecChoice.FP32, "FP16Compressor": CodecChoice.FP16}


def _codec_name(compression) -> CodecChoice:
    """The codec `compression` names (a string, a `Compression` member, or Horovod's or
    BytePS's compressor class), parsed here once."""
    if isinstance(compression, str):
        name = {"none": "fp32"}.get(compression.lower(), compression.lower())
    else:
        label = getattr(compression, "__name__", type(compression).__name__)
        name = _FOREIGN_CODECS.get(label)
        if name is None:
            raise UserError(f"compression={compression!r} is not a codec hetrain knows; use hetrain.Compression.none, "
                            ".fp16, .int8, .int4 or .auto (or Horovod's/BytePS's Compression.none / .fp16)")
    if name not in tuple(CodecChoice):
        raise UserError(f"compression={compression!r}: unknown codec {name!r}; choose one of "
                        f"{', '.join(CodecChoice)}")
    return CodecChoice(name)
