"""The ideal that bench/hetero.py's real-compute cases hold hetrain's balancing to
(bench/hetero_cases.py `compute_saved`), on hand-computed workers. In-process."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from hetero_cases import compute_saved  # noqa: E402


def test_without_fixed_parts_the_saving_is_the_slowest_equal_share_minus_the_harmonic_finish():
    slope = np.array([1e-4, 2e-4])
    # equal shares: 256 x 2e-4 = 51.2 ms; balanced: 512 / (1e4 + 5e3) = 34.13 ms
    assert compute_saved(np.zeros(2), slope, 512) == pytest.approx(0.0512 - 512 / 15000)


def test_fixed_parts_count_and_a_worker_slower_than_the_finish_sits_out():
    fixed, slope = np.array([0.001, 0.002]), np.array([1e-4, 2e-4])
    t = (512 + 10 + 10) / 15000  # Σ (T - f_i) / s_i = B
    assert compute_saved(fixed, slope, 512) == pytest.approx(0.002 + 0.0512 - t)
    # a third worker whose fixed part alone outlasts the others' finish takes nothing
    fixed3, slope3 = np.append(fixed, 0.5), np.append(slope, 1e-6)
    equal3 = 0.5 + 1e-6 * 512 / 3
    assert compute_saved(fixed3, slope3, 512) == pytest.approx(equal3 - t)


def test_a_measured_equal_step_below_the_fits_bounds_the_saving():
    slope = np.array([1e-4, 2e-4])
    assert compute_saved(np.zeros(2), slope, 512, equal=0.040) == pytest.approx(0.040 - 512 / 15000)
    assert compute_saved(np.zeros(2), slope, 512, equal=0.9) == pytest.approx(0.0512 - 512 / 15000)


def test_the_saving_is_averaged_over_the_steps_at_each_ones_own_global_batch():
    """An epoch's last global batch is partial: balancing saves less on it, and the ideal
    counts each measured step at the batch it had."""
    from hetero_cases import saved_per_step

    slope = np.array([1e-4, 2e-4])

    def step(b, slowest):  # (pre, forward, backward, sync, update, samples) per rank
        return [[0, slowest / 2, slowest / 2, 0, 0, b / 2], [0, slowest / 4, slowest / 4, 0, 0, b / 2]]

    full, part = step(512, 0.0512), step(232, 0.0232)
    steps = [full, full, part] * 2  # ranks come first in a run's phases: transpose below
    run = {"phases": np.transpose(np.asarray(steps), (1, 0, 2)).tolist()}
    expect = (2 * (0.0512 - 512 / 15000) + (0.0232 - 232 / 15000)) / 3
    # the first measured step is the one after `skip`
    assert saved_per_step(np.zeros(2), slope, run, skip=-1) == pytest.approx(expect)
    assert saved_per_step(np.zeros(2), slope, run, skip=-1) < compute_saved(np.zeros(2), slope, 512)


def test_the_static_oracle_shares_finish_together_and_fill_the_batch():
    """bench/real_worker.py's `ddp-static` kind: DDP given the shares that make every
    worker's fitted compute (fixed + slope x b) equal."""
    from real_worker import fixed_shares

    speed = {"fixed_s": [0.001, 0.002], "slope_s": [1e-4, 2e-4]}
    shares = fixed_shares(speed, 512)
    assert sum(shares) == 512
    t = (512 + 10 + 10) / 15000  # the common finish, as in compute_saved
    # (t - f) / s = 344.7 and 167.3 samples: the remainder goes to the larger fraction
    assert shares == [round((t - 0.001) / 1e-4), round((t - 0.002) / 2e-4)]


def test_each_worker_takes_its_faster_speed_measurement_of_a_repeat():
    """A slowdown that lands in one measurement (here worker 0's first) does not set the
    ideal: each worker's fit comes from its faster measurement, and how far the two were
    apart is reported."""
    from hetero_cases import repeat_speeds

    def speed(per, fixed):
        return {"per_sample_s": per, "fixed_s": fixed, "slope_s": [p * 0.9 for p in per]}

    runs = [speed([6e-5, 1.2e-4], [1e-3, 2e-3]), speed([5e-5, 1.25e-4], [5e-4, 2.5e-3]),  # repeat 0
            speed([5e-5, 1.2e-4], [5e-4, 2e-3]), speed([5e-5, 1.2e-4], [5e-4, 2e-3])]  # repeat 1
    got, apart = repeat_speeds(runs, 2)
    assert got[0] == {"per_sample_s": [5e-5, 1.2e-4], "fixed_s": [5e-4, 2e-3],
                      "slope_s": [runs[1]["slope_s"][0], runs[0]["slope_s"][1]]}
    assert apart == [pytest.approx(0.2), 0.0]
    # one measurement per repeat (older results): taken as it is
    got, apart = repeat_speeds(runs[:2], 2)
    assert got[1]["fixed_s"] == [5e-4, 2.5e-3] and apart == [0.0, 0.0]


def test_noise_penalty_is_what_the_later_worker_adds_to_the_best_fixed_split():
    """No noise: no penalty. Noise that makes the two workers late on alternate steps: the
    best fixed split still loses what the late worker adds, hand-computed below."""
    from hetero_noise import noise_penalty

    steps = 8
    ph = np.zeros((2, steps, 10))
    ph[:, :, 5] = 200  # samples: half each
    fixed, slope = [0.001, 0.001], [1e-4, 1e-4]  # both 21 ms on those shares: the calm best split
    ph[0, :, 1], ph[1, :, 1] = 0.021, 0.021
    assert noise_penalty(ph, fixed, slope) == pytest.approx(0.0, abs=1e-12)
    late = np.tile([1.2, 0.8], steps // 2)  # worker 0 20% late on even steps, worker 1 on odd ones
    ph[0, :, 1], ph[1, :, 1] = 0.021 * late, 0.021 * late[::-1]
    # the step is the late worker's 1.2 x its time, and moving samples to one worker
    # lengthens its late steps as much as it shortens the other's: 25.2 - 21 ms
    assert noise_penalty(ph, fixed, slope) == pytest.approx(0.0042, abs=1e-4)
    ph[1, 0, 5] = 0  # a worker that sat a step out: not replayed
    assert noise_penalty(ph, fixed, slope) is None
