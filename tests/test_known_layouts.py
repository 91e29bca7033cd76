"""comm/known.py: the layouts every rank remembers, with the epochs (partition-tag
blocks) they keep, so that one coming back is neither rebuilt nor re-published."""
from hetrain.comm.known import KnownLayouts


def test_a_layout_coming_back_keeps_its_epoch_and_state():
    k: KnownLayouts[str] = KnownLayouts(capacity=3)
    assert k.switch(11) == (1, False)
    assert k.switch(22) == (2, False)
    k.stash(11, "buffers of 11")
    assert k.switch(11) == (1, True)
    assert k.take(11) == "buffers of 11"
    assert k.take(11) is None  # handed back: its holder owns it again
    assert k.count == 2


def test_the_least_recent_layout_is_forgotten_with_its_state():
    k: KnownLayouts[str] = KnownLayouts(capacity=2)
    k.switch(1)
    k.stash(1, "one")
    k.switch(2)
    k.stash(2, "two")
    k.switch(1)  # 1 is the most recent now
    assert k.switch(3) == (3, False)  # evicts 2
    assert k.take(2) is None
    assert k.switch(2) == (4, False)  # new again, with a new epoch
    assert list(k.epochs) == [3, 2]
    assert k.take(1) is None  # evicted by 2's return


def test_stash_ignores_a_layout_no_longer_known():
    k: KnownLayouts[str] = KnownLayouts(capacity=1)
    k.switch(1)
    k.switch(2)  # evicts 1
    k.stash(1, "one")
    assert k.take(1) is None
