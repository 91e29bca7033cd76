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
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..runtime.env import CODECS, parse_rules  # noqa: F401  (the vocabulary is part of the job config)

BLOCK = 256  # elements per quantization scale
FP16_MAX = 65504.0


def _pad4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


@dataclass(frozen=True)
class Codec:
    """One gradient codec. `encode`/`decode` work on flat fp32 tensors and uint8 payloads."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise UserError(f"unknown codec {self.name!r}; choose one of {', '.join(CODECS)}")

    @property
    def lossy(self) -> bool:
        return self.name != "fp32"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}[self.name]

    def nbytes(self, n: int) -> int:
        """Payload bytes for a slice of n elements (depends on n only)."""
        if n <= 0:
            return 0
        if self.name == "fp32":
            return 4 * n
        if self.name == "fp16":
            return _pad4(2 * n)
        blocks = -(-n // BLOCK)
        body = n if self.name == "int8" else -(-n // 2)
        return 4 * blocks + _pad4(body)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """Stated per-element bound on |decode(encode(x)) − x| (for tests and docs)."""
        x = x.reshape(-1).float()
        if self.name == "fp32":
            return torch.zeros_like(x)
        if self.name == "fp16":  # half of fp16's spacing (11-bit significand), plus clamping
            c = x.clamp(-FP16_MAX, FP16_MAX)
            return (x - c).abs() + c.abs() * 2.0**-11 + 2.0**-25
        levels = 127 if self.name == "int8" else 7
        n = x.numel()
        blocks = -(-n // BLOCK)
        padded = torch.zeros(blocks * BLOCK, device=x.device)
        padded[:n] = x.abs()
        amax = padded.view(blocks, BLOCK).amax(1)
        return (amax / levels / 2 * (1 + 1e-5) + 1e-30).repeat_interleave(BLOCK)[:n]

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write the payload of flat fp32 `x` into uint8 `out` (len == nbytes(x.numel()))."""
        n = x.numel()
        if n == 0:
            return
        if self.name == "fp32":
            out.view(torch.float32).copy_(x)
            return
        if self.name == "fp16":
            out.view(torch.float16)[:n].copy_(x.clamp(-FP16_MAX, FP16_MAX))
            return
        levels = 127 if self.name == "int8" else 7
        blocks = -(-n // BLOCK)
        padded = torch.zeros(blocks * BLOCK, device=x.device)
        padded[:n] = x
        v = padded.view(blocks, BLOCK)
        scale = v.abs().amax(1) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(v / safe[:, None]).clamp_(-levels, levels).reshape(-1)[:n]
        out[: 4 * blocks].view(torch.float32).copy_(scale)
        body = out[4 * blocks:]
        if self.name == "int8":
            body[:n].view(torch.int8).copy_(q.to(torch.int8))
        else:
            u = (q + 8).to(torch.uint8)
            if n % 2:
                u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
            pairs = u.view(-1, 2)
            body[: pairs.shape[0]].copy_(pairs[:, 0] | (pairs[:, 1] << 4))

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the fp32 values of `payload` into flat `out` (its length says n)."""
        n = out.numel()
        if n == 0:
            return
        if self.name == "fp32":
            out.copy_(payload.view(torch.float32))
            return
        if self.name == "fp16":
            out.copy_(payload.view(torch.float16)[:n])
            return
        blocks = -(-n // BLOCK)
        scale = payload[: 4 * blocks].view(torch.float32)
        body = payload[4 * blocks:]
        if self.name == "int8":
            q = body[:n].view(torch.int8).float()
        else:
            packed = body[: -(-n // 2)]
            q = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n].float() - 8.0
        full = torch.zeros(blocks * BLOCK, device=out.device)
        full[:n] = q
        out.copy_((full.view(blocks, BLOCK) * scale[:, None]).reshape(-1)[:n])


FP32 = Codec("fp32")


def get(name: str) -> Codec:
    return FP32 if name == "fp32" else Codec(name)


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


def auto_codec(numel: int, bandwidth: float) -> str:
    """Pick a codec from the slowest link's bandwidth (bytes/s) and the tensor's size.

    Small tensors stay fp32. Larger ones get fewer bits as links get slower:
    ≥ 25 Gbit/s fp32, ≥ 5 Gbit/s fp16, ≥ 1 Gbit/s int8, slower int4. The thresholds
    keep the time to move a tensor at 4 bytes per element over 25 Gbit/s, i.e. about
    what an uncompressed gradient costs on a fast datacenter link.
    """
    if numel * 4 < AUTO_MIN_BYTES:
        return "fp32"
    gbit = bandwidth * 8 / 1e9
    if gbit >= 25:
        return "fp32"
    if gbit >= 5:
        return "fp16"
    if gbit >= 1:
        return "int8"
    return "int4"


def codec_for(name: str, numel: int, default: str, rules, bandwidth: float) -> str:
    """The codec of one tensor: the first matching rule, else the job default ('auto' allowed)."""
    choice = default
    for pattern, codec in rules:
        if fnmatch.fnmatchcase(name, pattern):
            choice = codec
            break
    return auto_codec(numel, bandwidth) if choice == "auto" else choice
