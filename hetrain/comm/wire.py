"""What each partition looks like on the wire when gradients are compressed.

Every rank (workers and servers) derives the same wire plan from the same manifest,
partition plan and job config, so encoded partitions have sizes all ranks agree on
without sending any metadata. A partition that crosses tensor boundaries is cut into
segments, one per tensor, each encoded with that tensor's codec.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..modes import Codec as CodecName
from .compress import Codec, ErrorFeedback, codec_for, get, parse_rules
from .layout import Manifest
from .partition import Partition


@dataclass(frozen=True)
class Segment:
    start: int  # element offset in the flat buffer
    length: int
    codec: Codec
    offset: int  # byte offset inside the partition's payload


@dataclass(frozen=True)
class WirePart:
    part: Partition
    segments: tuple[Segment, ...]
    nbytes: int  # payload bytes of this partition
    offset: int  # byte offset in the job's payload buffer


def tensor_codecs(manifest: Manifest, default: str, rules, bandwidth: float) -> list[CodecName]:
    parsed = parse_rules(rules)
    return [codec_for(e.name, e.numel, default, parsed, bandwidth) for e in manifest.entries]


def wire_codecs(manifest: Manifest, comm, cluster) -> list[CodecName]:
    """Each tensor's codec, the same on every rank (config and cluster are shared); `auto`
    reads the slowest NIC of the cluster."""
    bw = min(m.bandwidth for m in cluster.machines) if cluster is not None else float("inf")
    return tensor_codecs(manifest, comm.codec, comm.codec_rules, bw)


def wire_plan(parts: list[Partition], manifest: Manifest, codecs: list[CodecName | str]) -> list[WirePart] | None:
    """Segments and payload sizes per partition; None when everything travels as fp32."""
    codecs = [get(c) for c in codecs]  # the words of the job's config, parsed once per layout
    if not any(c.lossy for c in codecs):
        return None
    bounds = [0]
    for e in manifest.entries:
        bounds.append(bounds[-1] + e.numel)
    out, offset = [], 0
    for p in parts:
        segs, pos, nbytes = [], p.start, 0
        end = p.start + p.length
        i = bisect.bisect_right(bounds, pos) - 1
        while pos < end:
            while bounds[i + 1] <= pos:  # skip empty tensors
                i += 1
            stop = min(end, bounds[i + 1])
            codec = codecs[i]
            segs.append(Segment(pos, stop - pos, codec, nbytes))
            nbytes += codec.nbytes(stop - pos)
            pos = stop
        out.append(WirePart(p, tuple(segs), nbytes, offset))
        offset += nbytes
    return out


def payload_bytes(plan: list[WirePart]) -> int:
    return sum(w.nbytes for w in plan)


def encode_part(w: WirePart, flat: torch.Tensor, buf: torch.Tensor, feedback: ErrorFeedback) -> None:
    """Encode partition `w` of `flat` into `buf` (its w.nbytes payload bytes); lossy
    segments go through `feedback` (an ErrorFeedback over the flat buffer)."""
    for s in w.segments:
        out = buf[s.offset: s.offset + s.codec.nbytes(s.length)]
        x = flat[s.start: s.start + s.length]
        if s.codec.lossy:
            feedback.encode(s.codec, x, out, s.start)
        else:
            s.codec.encode(x, out)


def decode_part(w: WirePart, payload: torch.Tensor, flat: torch.Tensor, base: int = 0) -> None:
    """Decode the payload slice `payload` (this partition's bytes) into `flat`, whose
    element 0 is flat-buffer element `base`."""
    for s in w.segments:
        s.codec.decode(payload[s.offset: s.offset + s.codec.nbytes(s.length)],
                       flat[s.start - base: s.start - base + s.length])
