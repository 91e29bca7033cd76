"""The all-reduce bucket tuner (comm/buckets.py), in-process: which plans it tries, when
the workers agree, what it keeps."""
import pytest

from hetrain.comm.buckets import DDP_CAPS, BucketCaps, BucketTuner

MLP = [64 * 512, 512, 512 * 512, 512, 512 * 512, 512, 512 * 10, 10]  # 2.2 MB: DDP cuts two buckets


class Agree:
    """The collective's stand-in: the other workers report `device` (1.0: their steps run
    on a GPU) at the first agreement and `times` (per plan) at the second."""

    def __init__(self, device=0.0, times=(0.0, 0.0, 0.0)):
        self.calls, self.device, self.times = [], device, times

    def __call__(self, values):
        self.calls.append(list(values))
        other = [self.device] if len(self.calls) == 1 else self.times
        return [max(a, b) for a, b in zip(values, other)]


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


def test_plans_that_cut_alike_are_tried_once_in_interleaved_blocks_and_the_faster_is_kept():
    agree = Agree()
    tuner = BucketTuner(MLP, agree)  # 25 MiB and 100 MiB caps both give one bucket: two plans
    assert [len(parts) for _caps, parts in tuner.options] == [2, 1] and tuner.trial_steps == 22
    seen = []
    changes = run(tuner, lambda o: seen.append(o) or (0.020 if o == 0 else 0.018), 40)
    # 2 warm-up steps, then blocks of 1 settling + 4 measured steps: A B, B A, then the faster
    assert seen[:22] == [0] * 7 + [1] * 10 + [0] * 5 and set(seen[22:]) == {1}
    assert changes == [(7, 1), (17, 0), (22, 1)] and tuner.done and tuner.caps == BucketCaps(25 * 2**20, 25 * 2**20)
    assert agree.calls == [[0.0], pytest.approx([0.020, 0.018])] and tuner.times == pytest.approx([0.020, 0.018])


@pytest.mark.parametrize("others, kept", [((0.0, 0.0), 0), ((0.030, 0.030), 0), ((0.0, 0.0198), 0)])
def test_ddp_plan_kept_unless_clearly_faster_on_every_worker(others, kept):
    """1% faster here is within the margin; a slower worker elsewhere (the agreed time is
    the slowest's) decides for everyone."""
    agree = Agree(times=others)
    tuner = BucketTuner(MLP, agree)
    changes = run(tuner, lambda o: 0.020 if o == 0 else 0.0198, 40)
    assert tuner.done and tuner.current == kept and changes == [(7, 1), (17, 0)]  # the last block was DDP's


def test_a_drifting_host_slows_every_plan_alike():
    """Steps slow down by 1% a step all through the trials (a fifth in all): mirrored
    rounds still find the plan that is 4% faster at every moment, which one-block-each
    trials (the first plan measured early, the other late) would miss."""
    tuner = BucketTuner(MLP, Agree())
    clock = iter(range(100))
    run(tuner, lambda o: (1 + 0.01 * next(clock)) * (0.020 if o == 0 else 0.0192), 30)
    assert tuner.done and tuner.current == 1


def test_a_step_on_a_gpu_keeps_ddp_plan_untried():
    agree = Agree(device=1.0)  # another worker's steps run on its GPU
    tuner = BucketTuner(MLP, agree)
    assert run(tuner, lambda o: 0.02, 30) == [] and tuner.done and tuner.current == 0 and agree.calls == [[0.0]]
