"""Rows that ride the gradient all-reduce (comm/cargo.py) and the balancer's exchange
that uses them (train/exchange.py): pure parts, in-process; two workers' all-reduce is
stood in for by summing what each would send."""
import numpy as np
import torch

from hetrain.comm.cargo import CARGO_MAX, CARGO_ROOM, CargoHold, carrier
from hetrain.comm.flatlayout import FlatLayout
from hetrain.comm.layout import Manifest
from hetrain.comm.partition import plan_buckets
from hetrain.comm.staging import HostInPlace
from hetrain.train.exchange import carried, exchange_rows, ready


def test_the_carrier_is_the_smallest_bucket_with_room_else_a_small_one_copied():
    assert carrier([50, 10, 30], [True, False, True]) == 2  # room: no copy, the smallest such
    assert carrier([50, 10, 30], [False, False, False]) == 1  # a copy of the smallest
    assert carrier([CARGO_MAX + 1], [False]) is None  # one big bucket in the user's gradient: gather
    assert carrier([CARGO_MAX + 1], [True]) == 0
    assert carrier([], []) is None


def _staging():
    """Buckets over a model's gradients: buffered ones (several tensors: spare room after
    them) and one inside a single large tensor (no room)."""
    ts = [torch.randn(300), torch.randn(7), torch.randn(5), torch.randn(40)]
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, plan_buckets([t.numel() for t in ts], 60, 200))
    return ts, lay


def _worker_step(ts, lay, hold, row, slot):
    """One worker's step: fill every bucket, load the cargo where it rides, and return
    (its staging, the buffers it would all-reduce by bucket)."""
    s = HostInPlace(lay)
    s.begin(1.0)
    for i in reversed(range(len(ts))):
        s.fill(i, ts[i], 0, ts[i].numel())
    assert hold.attach(row, slot, 2, s) is not None
    return s, {pid: hold.load(pid, s.work_view(pid), s) for pid in range(len(lay.parts))}


def test_rows_ride_a_bucket_and_the_gradients_sum_as_without_them():
    ts, lay = _staging()
    assert any(len(sp) == 1 for sp in lay.spans) and any(len(sp) > 1 for sp in lay.spans)
    holds = [CargoHold(), CargoHold()]
    rows = [np.array([1e-3, 3.5e-5, 331.0]), np.array([2e-3, 7e-5, 181.0])]
    mine = [[t.clone() for t in ts] for _ in holds]  # each worker's gradients (the same values)
    steps = [_worker_step(m, lay, h, r, k) for k, (m, h, r) in enumerate(zip(mine, holds, rows))]
    rode = [pid for pid, sent in steps[0][1].items() if sent.numel() != lay.parts[pid].length]
    assert len(rode) == 1 and len(lay.spans[rode[0]]) > 1  # one bucket, a buffered one: in its room
    pid = rode[0]
    assert steps[0][1][pid].numel() == lay.parts[pid].length + 2 * 3 <= lay.parts[pid].length + CARGO_ROOM
    for p in range(len(lay.parts)):  # the all-reduce: each worker ends with the sum
        total = steps[0][1][p] + steps[1][1][p]
        for _s, sent in steps:
            sent[p].copy_(total)
    cargos = [h.riding[0] for h in holds]
    for h, (s, _sent), m in zip(holds, steps, mine):
        for p in range(len(lay.parts)):
            h.unload(p)
            s.deliver(p)
        s.complete(m)
    for c in cargos:  # every worker's row, as float32 carried them, in every worker's hands
        np.testing.assert_array_equal(c.rows, np.stack(rows).astype(np.float32).astype(np.float64))
    for r in mine:  # the gradients: the sum of the two workers', trailer or not
        for got, t in zip(r, ts):
            torch.testing.assert_close(got, 2 * t)


def test_a_small_bucket_without_room_is_copied_with_the_trailer():
    ts = [torch.randn(20), torch.randn(300)]  # two buckets, each one tensor: no buffers, no room
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, plan_buckets([t.numel() for t in ts], 20, 20))
    orig = [t.clone() for t in ts]
    hold = CargoHold()
    s, sent = _worker_step(ts, lay, hold, np.array([5.0, 6.0]), 1)
    small = min(range(len(lay.parts)), key=lambda p: lay.parts[p].length)
    view = hold.riding[2]
    assert sent[small].numel() == view.numel() + 4 and sent[small].data_ptr() != view.data_ptr()
    assert sent[small][view.numel():].tolist() == [0.0, 0.0, 5.0, 6.0]  # slot 1 of 2
    sent[small].mul_(2)  # the all-reduce of two workers holding the same values
    cargo = hold.riding[0]
    hold.unload(small)
    torch.testing.assert_close(view, 2 * orig[0])  # the sum went back into the bucket (tensor 0 itself)
    assert cargo.rows.tolist() == [[0.0, 0.0], [10.0, 12.0]]


def test_an_exchange_whose_cargo_never_rode_is_gathered():
    """A cargo still pending when its rows are wanted (no step ran: the end of training)
    is dropped, and the rows come from the gather; one that rode gives its rows, and is
    not to be completed from inside its own step before that (`ready`)."""
    gathered = []

    def gather(row):
        gathered.append(row)
        return lambda: np.stack([row, row + 1])

    ts, lay = _staging()
    s = HostInPlace(lay)
    hold = CargoHold()
    wait = exchange_rows(np.array([1.0, 2.0]), gather, lambda row: hold.attach(row, 0, 2, s))
    assert not gathered and not ready(wait) and not carried(wait)
    cargo = hold.pending
    assert wait().tolist() == [[1.0, 2.0], [2.0, 3.0]] and len(gathered) == 1 and cargo.dropped
    bucket = s.buffers[cargo.bucket]
    assert hold.load(cargo.bucket, bucket, s) is bucket and hold.riding is None  # a dropped cargo never rides
    wait = exchange_rows(np.array([1.0, 2.0]), gather, lambda row: hold.attach(row, 0, 2, s))
    other = HostInPlace(FlatLayout.build(lay.manifest, lay.parts))  # another layout: the cargo stays pending
    theirs = other.buffers[hold.pending.bucket]
    assert hold.load(hold.pending.bucket, theirs, other) is theirs  # the bucket alone, no trailer
    assert hold.riding is None and hold.pending is not None
    hold.pending.rows = np.array([[1.0, 2.0], [3.0, 4.0]])  # its bucket's sum came in
    assert ready(wait) and carried(wait) and wait().tolist() == [[1.0, 2.0], [3.0, 4.0]] and len(gathered) == 1
    assert ready(exchange_rows(np.zeros(2), gather, None))  # no carrier: a gather of its own
