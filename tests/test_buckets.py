"""The all-reduce bucket tuner (comm/buckets.py), in-process: which plans it tries, when
the workers agree, what it keeps."""
import pytest

from hetrain.comm.buckets import DDP_CAPS, BucketCaps, BucketTuner

MLP = [64 * 512, 512, 512 * 512, 512, 512 * 512, 512, 512 * 10, 10]  # 2.2 MB: DDP cuts two buckets


class Agree:
    """The collective's stand-in: every other worker reports `others` (time, on-device)."""

    def __init__(self, others=(0.0, 0.0)):
        self.calls, self.others = [], others

    def __call__(self, values):
        self.calls.append(list(values))
        return [max(a, b) for a, b in zip(values, self.others)]


def run(tuner, step_s, steps, on_device=False):
    """End `steps` steps; `step_s(option)` is how long a step under that option takes."""
    changes = []
    for k in range(steps):
        if tuner.step_done(step_s(tuner.current), on_device):
            changes.append((k + 1, tuner.current))
    return changes


def test_a_model_of_one_bucket_is_never_tuned():
    agree = Agree()
    tuner = BucketTuner([1000, 10, 3000], agree)
    assert tuner.done and tuner.caps == DDP_CAPS and len(tuner.parts) == 1
    assert run(tuner, lambda o: 0.01, 40) == [] and agree.calls == []


def test_plans_that_cut_alike_are_tried_once_and_the_faster_is_kept():
    agree = Agree()
    tuner = BucketTuner(MLP, agree)  # 25 MiB and 100 MiB caps both give one bucket: two plans
    assert [len(parts) for _caps, parts in tuner.options] == [2, 1]
    changes = run(tuner, lambda o: 0.020 if o == 0 else 0.018, 30)
    # DDP's plan: 2 warm-up + 1 settling + 5 measured steps, then one bucket: 1 + 5
    assert changes == [(8, 1)] and tuner.done and tuner.caps == BucketCaps(25 * 2**20, 25 * 2**20)
    assert [c[1] for c in agree.calls] == [0.0, 0.0] and tuner.times == pytest.approx([0.020, 0.018])


@pytest.mark.parametrize("others, kept", [((0.0, 0.0), 0), ((0.030, 0.0), 0)])
def test_ddp_plan_kept_unless_clearly_faster_on_every_worker(others, kept):
    """1% faster here is within the margin; a slower worker elsewhere (the agreed time is
    the slowest's) decides for everyone."""
    agree = Agree(others)
    tuner = BucketTuner(MLP, agree)
    changes = run(tuner, lambda o: 0.020 if o == 0 else 0.0198, 30)
    assert tuner.done and tuner.current == kept and changes == [(8, 1), (14, 0)]


def test_a_step_on_a_gpu_ends_tuning_with_ddp_plan():
    agree = Agree((0.0, 1.0))  # another worker's steps run on its GPU
    tuner = BucketTuner(MLP, agree)
    assert run(tuner, lambda o: 0.02, 30) == [] and tuner.done and tuner.current == 0 and len(agree.calls) == 1
