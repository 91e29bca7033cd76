"""Gradient codecs (H-PS's flexible quantization): fp32, fp16, 8-bit and 4-bit.

A codec turns a 1-D fp32 slice into a fixed-size uint8 payload and back. The size
depends only on the slice length, so every rank knows every buffer size in advance
(gloo needs matching send/recv sizes) and nothing but raw numbers crosses the network:
per-block scales are carried inside the payload as fp32 bytes, never pickled.

Lossy codecs are used with error feedback (`ErrorFeedback`): what quantization drops
this step is added back before the next encode, so no gradient mass is lost over time.

Payload layouts (every section padded to a multiple of 4 bytes):
  fp32  : n × float32
  fp16  : n × float16 (values clamped to ±65504)
  int8  : ceil(n/B) × float32 scale, then n × int8 in [-127, 127]          (B = 256)
  int4  : ceil(n/B) × float32 scale, then ceil(n/2) bytes of two nibbles in [-7, 7] + 8
"""
from __future__ import annotations

import fnmatch

import torch

from ..modes import Codec as CodecName, CodecChoice
from ..runtime.env import CODECS, parse_rules  # noqa: F401  (the vocabulary is part of the job config)

BLOCK = 256  # elements per quantization scale
FP16_MAX = 65504.0


def _pad4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


class Codec:
    """One gradient codec. `encode`/`decode` work on flat fp32 tensors and uint8 payloads.
    One class per payload layout (see the module docstring), chosen once by `get`."""

    name: CodecName
    lossy = True

    @property
    def bits(self) -> int:
        return self.name.bits

    def __repr__(self) -> str:
        return f"Codec({self.name.value!r})"

    def nbytes(self, n: int) -> int:  # pragma: no cover - interface
        """Payload bytes for a slice of n elements (depends on n only)."""
        raise NotImplementedError

    def max_error(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Stated per-element bound on |decode(encode(x)) − x| (for tests and docs)."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:  # pragma: no cover - interface
        """Write the payload of flat fp32 `x` into uint8 `out` (len == nbytes(x.numel()))."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:  # pragma: no cover - interface
        """Write the fp32 values of `payload` into flat `out` (its length says n)."""
        raise NotImplementedError


class _Fp32(Codec):
    name, lossy = CodecName.FP32, False

    def nbytes(self, n: int) -> int:
        return 4 * max(n, 0)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x.reshape(-1).float())

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if x.numel():
            out.view(torch.float32).copy_(x)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        if out.numel():
            out.copy_(payload.view(torch.float32))


class _Fp16(Codec):
    name = CodecName.FP16

    def nbytes(self, n: int) -> int:
        return _pad4(2 * n) if n > 0 else 0

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """Half of fp16's spacing (11-bit significand), plus clamping."""
        x = x.reshape(-1).float()
        c = x.clamp(-FP16_MAX, FP16_MAX)
        return (x - c).abs() + c.abs() * 2.0**-11 + 2.0**-25

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.numel()
        if n:
            out.view(torch.float16)[:n].copy_(x.clamp(-FP16_MAX, FP16_MAX))

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        if n:
            out.copy_(payload.view(torch.float16)[:n])


class _Blocks(Codec):
    """int8 / int4: per block of BLOCK elements an fp32 scale, then the levels."""

    levels: int

    def _body(self, n: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def nbytes(self, n: int) -> int:
        return 4 * -(-n // BLOCK) + _pad4(self._body(n)) if n > 0 else 0

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1).float()
        n = x.numel()
        blocks = -(-n // BLOCK)
        padded = torch.zeros(blocks * BLOCK, device=x.device)
        padded[:n] = x.abs()
        amax = padded.view(blocks, BLOCK).amax(1)
        return (amax / self.levels / 2 * (1 + 1e-5) + 1e-30).repeat_interleave(BLOCK)[:n]

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        blocks = -(-n // BLOCK)
        padded = torch.zeros(blocks * BLOCK, device=x.device)
        padded[:n] = x
        v = padded.view(blocks, BLOCK)
        scale = v.abs().amax(1) / self.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(v / safe[:, None]).clamp_(-self.levels, self.levels).reshape(-1)[:n]
        out[: 4 * blocks].view(torch.float32).copy_(scale)
        self._pack(q, out[4 * blocks:])

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        if n == 0:
            return
        blocks = -(-n // BLOCK)
        scale = payload[: 4 * blocks].view(torch.float32)
        full = torch.zeros(blocks * BLOCK, device=out.device)
        full[:n] = self._unpack(payload[4 * blocks:], n)
        out.copy_((full.view(blocks, BLOCK) * scale[:, None]).reshape(-1)[:n])


class _Int8(_Blocks):
    name, levels = CodecName.INT8, 127

    def _body(self, n: int) -> int:
        return n

    def _pack(self, q: torch.Tensor, body: torch.Tensor) -> None:
        body[:q.numel()].view(torch.int8).copy_(q.to(torch.int8))

    def _unpack(self, body: torch.Tensor, n: int) -> torch.Tensor:
        return body[:n].view(torch.int8).float()


class _Int4(_Blocks):
    name, levels = CodecName.INT4, 7

    def _body(self, n: int) -> int:
        return -(-n // 2)

    def _pack(self, q: torch.Tensor, body: torch.Tensor) -> None:
        u = (q + 8).to(torch.uint8)
        if q.numel() % 2:
            u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
        pairs = u.view(-1, 2)
        body[: pairs.shape[0]].copy_(pairs[:, 0] | (pairs[:, 1] << 4))

    def _unpack(self, body: torch.Tensor, n: int) -> torch.Tensor:
        packed = body[: -(-n // 2)]
        return torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n].float() - 8.0


_CODECS: dict[CodecName, Codec] = {c.name: c for c in (_Fp32(), _Fp16(), _Int8(), _Int4())}
FP32 = _CODECS[CodecName.FP32]


def get(name: CodecName | str) -> Codec:
    """The codec named `name` (a UserError naming the codecs otherwise)."""
    return _CODECS[CodecName.parse(name)]


class ErrorFeedback:
    """Encode with error feedback: carry what the codec dropped into the next encode.

    `residual` covers a flat buffer; encode(codec, x, out, start) sends x + residual
    and keeps (x + residual) − decoded for next time, so Σ decoded = Σ x − residual:
    the running sum of what arrives tracks the running sum of gradients within one
    step's quantization error, whatever the codec.
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu"):
        # on a GPU worker the residual stays on the GPU: codecs encode there, before the copy
        self.residual = torch.zeros(numel, device=device)
        self._tmp = torch.empty(numel, device=device)

    def encode(self, codec: Codec, x: torch.Tensor, out: torch.Tensor, start: int = 0) -> None:
        n = x.numel()
        res = self.residual[start: start + n]
        v = self._tmp[start: start + n]
        torch.add(x, res, out=v)
        codec.encode(v, out)
        codec.decode(out, res)  # res := decoded
        torch.sub(v, res, out=res)  # res := v − decoded


# ---- which codec for which tensor ------------------------------------------------------------
AUTO_MIN_BYTES = 64 * 1024  # smaller tensors are latency-bound: compression gains nothing


def auto_codec(numel: int, bandwidth: float) -> CodecName:
    """Pick a codec from the slowest link's bandwidth (bytes/s) and the tensor's size.

    Small tensors stay fp32. Larger ones get fewer bits as links get slower:
    ≥ 25 Gbit/s fp32, ≥ 5 Gbit/s fp16, ≥ 1 Gbit/s int8, slower int4. The thresholds
    keep the time to move a tensor at 4 bytes per element over 25 Gbit/s, i.e. about
    what an uncompressed gradient costs on a fast datacenter link.
    """
    if numel * 4 < AUTO_MIN_BYTES:
        return CodecName.FP32
    gbit = bandwidth * 8 / 1e9
    if gbit >= 25:
        return CodecName.FP32
    if gbit >= 5:
        return CodecName.FP16
    if gbit >= 1:
        return CodecName.INT8
    return CodecName.INT4


def codec_for(name: str, numel: int, default: CodecChoice | str, rules, bandwidth: float) -> CodecName:
    """The codec of one tensor: the first matching rule, else the job default ('auto' allowed)."""
    choice = CodecChoice.parse(default)
    for pattern, codec in rules:
        if fnmatch.fnmatchcase(name, pattern):
            choice = CodecChoice.parse(codec)
            break
    return choice.codec or auto_codec(numel, bandwidth)
