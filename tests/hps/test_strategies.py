"""The two balancing strategies (unequal local batches; equal micro-batches with a count
per worker) and workers whose best share is zero: pure parts and the loader, in-process."""
import numpy as np
import pytest
import torch

from hetrain.errors import UserError
from hetrain.perf.steptime import plan_accumulate, plan_step, plan_time, plan_unequal, solve_shares, useful_workers
from hetrain.train.balance import BalanceConfig, Balancer
from hetrain.train.loader import BalancedBatchSampler, BalancedLoader
from tests.hps.test_loader import ThreadGroup, run_workers
from tests.hps.test_step_model import _fake_gather


def test_a_worker_too_slow_to_help_gets_no_share():
    # worker 2's fixed cost alone (0.5 s) exceeds the step the others make without it
    fixed, per = [0.01, 0.01, 0.5], [1e-3, 1e-3, 1e-3]
    assert useful_workers(100, fixed, per, [100] * 3).tolist() == [True, True, False]
    plan = plan_unequal(100, fixed, per, [100] * 3)
    assert plan.sizes.tolist() == [50, 50, 0] and plan.predicted == pytest.approx(0.06)
    # slow but useful: it keeps a share
    assert plan_unequal(100, [0.01, 0.01, 0.01], [1e-3, 1e-3, 4e-3], [100] * 3).sizes.tolist() == [45, 44, 11]
    # needed for memory: kept even though slow
    assert plan_unequal(100, fixed, per, [40, 40, 100]).sizes.tolist() == [40, 40, 20]


def test_several_equal_stragglers_all_leave_the_step():
    """A GPU beside three CPU workers whose fixed parts (4 ms) each exceed the GPU's whole
    step (2.8 ms for the batch): leaving out any one CPU worker alone changes nothing, all
    three together make the step 30% shorter, so all three sit out."""
    fixed = [0.0024, 0.0038, 0.0041, 0.0041]
    per = [5.3e-8, 4.8e-5, 8.8e-5, 4.7e-5]
    assert useful_workers(8192, fixed, per, [8192] * 4).tolist() == [True, False, False, False]
    plan = plan_unequal(8192, fixed, per, [8192] * 4)
    assert plan.sizes.tolist() == [8192, 0, 0, 0]
    assert plan.predicted == pytest.approx(0.0024 + 8192 * 5.3e-8)


def test_a_worker_whose_share_is_a_sliver_sits_out():
    """Three CPU workers beside a GPU whose fits make their best shares 1 to 5% of an
    equal share: each would shorten the compute by well under 1%, and in the step they
    cost what the fits do not see (their exchange, their load on the host), so they sit
    out; a slow worker whose share is a third of the batch stays."""
    fixed = [1.84e-3, 1.27e-3, 1.96e-3, 1.16e-3]
    per = [2.1e-8, 4.76e-6, 1.7e-6, 5.9e-6]
    both = solve_shares(16384, fixed, per, [16384] * 4)
    assert all(0 < b < 0.1 * 4096 for b in both[1:]), both
    assert useful_workers(16384, fixed, per, [16384] * 4).tolist() == [True, False, False, False]
    assert plan_unequal(16384, fixed, per, [16384] * 4).sizes.tolist() == [16384, 0, 0, 0]
    assert plan_unequal(512, [0.0, 0.0], [1e-4, 2e-4], [512, 512]).sizes.tolist() == [342, 170]
    # small_share=0 (BalanceConfig.small_share): only workers too slow to help at all sit out
    assert plan_unequal(16384, fixed, per, [16384] * 4, small_share=0.0).sizes.tolist() == both.tolist()
    with pytest.raises(UserError, match="small_share"):
        BalanceConfig(small_share=1.0)


def test_the_balancer_takes_small_share_from_its_config():
    """The other worker reports 1 ms a sample, this one measures 10 us: its best share is
    9 samples of 1000, 2% of an equal share. By default it sits out; with
    BalanceConfig(small_share=0) it keeps them."""
    def balancer(**cfg):
        b = Balancer(None, 1000, BalanceConfig(overlap_exchange=False, every=1, **cfg),
                     gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.001]), num_workers=2)
        b.record(500, 0.005)
        b.update()
        return b.sizes.tolist()

    assert balancer() == [1000, 0]
    assert balancer(small_share=0.0) == [991, 9]


def test_a_worker_that_sat_out_for_a_sliver_rejoins_only_well_above_it():
    """Hysteresis on the small-share rule: this worker measures 10 us a sample; the other's
    per-sample time moves between exchanges. Its best share: 2% of an equal share (out),
    12.5% (still out: it left, and rejoins only at twice the 10% threshold), 33% (in),
    12.5% again (stays: a worker in keeps its place down to 10%). With rejoin=1 it comes
    back at 12.5% at once."""
    other = [[0.0, p] for p in (1e-3, 1.5e-4, 5e-5, 1.5e-4)]

    def shares(**cfg):
        b = Balancer(None, 1000, BalanceConfig(overlap_exchange=False, every=1, **cfg),
                     gather=_fake_gather([np.inf, 5, 0, 0, 1], *other), num_workers=2)
        seen = []
        for _ in other:
            b.record(int(b.sizes[0]), 1e-5 * int(b.sizes[0]))
            seen.append(int(b.update()[1]))
        return seen

    assert shares() == [0, 0, 166, 62]
    assert shares(rejoin=1.0) == [0, 62, 166, 62]
    with pytest.raises(UserError, match="rejoin"):
        BalanceConfig(rejoin=0.5)


def test_zero_share_worker_leaves_the_step_and_rejoins():
    """The other worker reports a huge fixed part: it leaves (share 0); when its fit says
    it helps again it rejoins."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [1.0, 0.001], [0.0, 0.002]), num_workers=2)
    assert b.sizes.tolist() == [50, 50]
    b.record(50, 0.1)  # this worker: 2 ms per sample
    b.update()
    assert b.sizes.tolist() == [100, 0]  # 1 s fixed for the other: the whole batch here takes 0.2 s
    b.record(100, 0.2)
    b.update()
    assert b.sizes.tolist() == [50, 50]  # it is as fast again: back in the step


def test_a_dataloader_keeps_every_worker_in_the_step():
    """A DataLoader cannot collate an empty batch: driven as its batch_sampler, the
    balancer keeps the worker too slow to help (one sample at least); a worker capped at
    0 samples, and an epoch's last batch smaller than the workers, are clear errors."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [1.0, 0.001]), num_workers=2)
    b.record(50, 0.1)
    b.update()
    assert b.sizes.tolist() == [100, 0]
    b.require_every_worker("a DataLoader's batch_sampler must yield non-empty batches")
    assert b.sizes.min() >= 1 and b.sizes.sum() == 100 and b.plan_for(60).sizes.min() >= 1
    capped = Balancer(None, 100, BalanceConfig(), gather=_fake_gather([np.inf, 5, 0, 0, 1]), num_workers=2,
                      caps=[100, 0], labels=["a", "b"])
    with pytest.raises(UserError, match=r"worker\(s\) b may take no sample.*BalancedLoader"):
        capped.require_every_worker("a DataLoader's batch_sampler must yield non-empty batches")

    def body(rank, sampler):
        return [len(i) for i in torch.utils.data.DataLoader(torch.arange(21), batch_sampler=sampler)]

    with pytest.raises(UserError, match="last batch has 1 sample.*drop_last=True"):
        run_workers(2, lambda g: BalancedBatchSampler(21, 10, group=g, device=torch.device("cpu")), body)
    got = run_workers(2, lambda g: BalancedBatchSampler(21, 10, group=g, device=torch.device("cpu"), drop_last=True),
                      body)
    assert got == [[5, 5], [5, 5]]


def test_accumulate_counts_follow_speed_and_cover_the_batch():
    plan = plan_accumulate(96, 8, [0.0, 0.0], [1e-3, 2e-3])
    assert plan.strategy == "accumulate" and plan.micro == 8
    assert plan.counts.tolist() == [8, 4] and plan.sizes.tolist() == [64, 32]
    short = plan_accumulate(100, 8, [0.0, 0.0], [1e-3, 2e-3])  # 13 micro-batches, the last one short
    assert short.sizes.sum() == 100 and short.counts.sum() == 13
    with pytest.raises(UserError, match="micro-batch must be >= 1"):
        plan_accumulate(100, 0, [0.0], [1e-3])


def test_the_cost_model_picks_the_faster_strategy():
    fixed, per = [0.01, 0.01], [1e-3, 3e-3]
    # no memory limit: one pass per worker is never slower (finer shares, no repeated fixed part)
    auto = plan_step(128, fixed, per, [128, 128], micro=16, pass_fixed=fixed)
    assert auto.strategy == "unequal"
    # the fast worker's memory holds 40 samples: unequal batches must give the slow one the
    # rest; micro-batches of 16 fit, so the fast worker accumulates its larger share
    capped = plan_step(128, fixed, per, [40, 128], micro=16, micro_caps=[128, 128], pass_fixed=[0.001] * 2)
    assert capped.strategy == "accumulate" and capped.sizes[0] > 40
    forced = plan_step(128, fixed, per, [128, 128], micro=16, strategy="accumulate")
    assert forced.strategy == "accumulate"
    with pytest.raises(UserError, match="strategy"):
        plan_step(128, fixed, per, [128, 128], strategy="fastest")


@pytest.mark.parametrize("strategy", ["unequal", "accumulate"])
def test_resume_mid_epoch_with_either_strategy(strategy):
    """A position committed mid-epoch resumes on two workers: every remaining sample of
    the epoch once, passes of equal micro-batches (accumulate) or one per worker."""
    data = torch.arange(48)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def make(group, optimizer=None):
        return BalancedLoader(torch.utils.data.TensorDataset(data), 12, device="cpu", group=group, seed=3,
                              optimizer=optimizer, strategy=strategy, micro_batch=3)

    first = make(ThreadGroup(1).group(0), opt)
    done = []
    for (x,) in first:
        done += x.tolist()
        opt.step()
        if first.step == 2:
            break
    saved = first.state_dict()
    assert saved["step"] == 2 and len(done) == 24

    def body(rank, loader):
        loader.load_state_dict(saved)
        got, passes = [], []
        for (x,) in loader:
            got += x.tolist()
            passes.append([len(m) for m in loader.micro_batches(x)])
        return got, passes

    res = run_workers(2, make, body)
    rest = res[0][0] + res[1][0]
    assert sorted(done + rest) == list(range(48))
    for _got, passes in res:
        for p in passes:
            assert sum(p) > 0
            if strategy == "accumulate":
                assert all(n == 3 for n in p), p
            else:
                assert len(p) == 1


def _useful_by_search(g, fixed, per, caps, min_samples=1, margin=0.1):
    """useful_workers' definition, searched in full: of the sets that leave out the k
    slowest minimums (k = 0, 1, ...; a worker the rest need for the batch stays), the one
    with the shortest predicted step, if that beats keeping everyone by more than `margin`;
    then whoever's share is under a tenth of an equal share leaves, until nobody's is."""
    from hetrain.perf.steptime import predicted_times, solve_shares

    fixed, per = np.asarray(fixed, dtype=float), np.asarray(per, dtype=float)
    caps = np.minimum(np.asarray(caps), g)
    keep = caps > 0

    def step(mask):
        sizes = solve_shares(g, np.where(mask, fixed, 0), np.where(mask, per, 1.0), np.where(mask, caps, 0),
                             min_samples)
        return float(np.max(predicted_times(sizes, fixed, per)[sizes > 0]))

    everyone = step(keep)
    sets, trial = [(everyone, keep)], keep.copy()
    for i in np.argsort(-(fixed + per * min_samples), kind="stable"):
        if trial.sum() <= 1:
            break
        if not trial[i]:
            continue
        trial[i] = False
        if caps[trial].sum() < g:
            trial[i] = True
            continue
        sets.append((step(trial), trial.copy()))
    t, best = min(sets, key=lambda s: s[0])  # the first of equal times: the fewest dropped
    keep = best if t < everyone * (1 - margin) else keep
    if min_samples < 1:
        return keep
    while keep.sum() > 1:  # then the shares under a tenth of an equal one, smallest first
        sizes = solve_shares(g, np.where(keep, fixed, 0), np.where(keep, per, 1.0), np.where(keep, caps, 0),
                             min_samples)
        trial = keep.copy()
        for i in sorted(np.flatnonzero(keep & (sizes < 0.1 * g / keep.sum())), key=lambda i: sizes[i]):
            if trial.sum() <= 1:
                break
            trial[i] = False
            if caps[trial].sum() < g:
                trial[i] = True
        if (trial == keep).all():
            break
        keep = trial
    return keep


def test_who_helps_matches_the_full_search():
    """useful_workers decides most cases from one solve (nobody held at its minimum is the
    bottleneck); on random clusters, stragglers and huge fixed parts included, it keeps
    exactly the workers the full drop search keeps, and plan_unequal gives their shares."""
    from hetrain.perf.steptime import solve_shares

    rng = np.random.default_rng(7)
    for _ in range(3000):
        n, g = int(rng.integers(1, 6)), int(rng.integers(1, 500))
        fixed = rng.uniform(0, 0.05, n) * (rng.uniform(0, 1, n) < 0.7)
        per = 10 ** rng.uniform(-6, -1, n)
        caps = (rng.uniform(0, 2, n) * g).astype(np.int64)
        m = int(rng.integers(0, 4))
        if caps.sum() < g:
            continue
        want = _useful_by_search(g, fixed, per, caps, m)
        assert useful_workers(g, fixed, per, caps, m).tolist() == want.tolist()
        assert plan_unequal(g, fixed, per, caps, m).sizes.tolist() == solve_shares(
            g, fixed, per, np.where(want, caps, 0), m).tolist()


def test_a_split_is_kept_until_a_new_one_is_worth_new_batch_shapes():
    """BalanceConfig.hold: this worker measures 1 ms a sample; the other's per-sample time
    moves from 1 ms to 1.01 ms (the new split would save 0.4% of the step: both the full
    batch's and an epoch's last batch's splits stay) and then to 2 ms (re-split at once).
    With hold=0 every move re-splits."""
    other = [[0.0, p] for p in (1e-3, 1.01e-3, 2e-3)]

    def shares(**cfg):
        b = Balancer(None, 1000, BalanceConfig(overlap_exchange=False, every=1, **cfg),
                     gather=_fake_gather([np.inf, 5, 0, 0, 1], *other), num_workers=2)
        seen = []
        for _ in other:
            b.record(int(b.sizes[0]), 1e-3 * int(b.sizes[0]))
            full = b.update().tolist()
            seen.append((full, b.plan_for(300).sizes.tolist()))
        return seen

    assert shares() == [([500, 500], [150, 150]), ([500, 500], [150, 150]), ([667, 333], [200, 100])]
    assert shares(hold=0.0) == [([500, 500], [150, 150]), ([502, 498], [151, 149]), ([667, 333], [200, 100])]
    with pytest.raises(UserError, match="hold"):
        BalanceConfig(hold=1.0)


def test_plan_time_prices_a_plan_under_other_fits():
    """The step a plan made with older fits takes under new ones: its slowest worker that
    takes part, as the planners price their own plans (accumulating: a pass per micro-batch)."""
    une = plan_step(100, [0.0, 0.0], [1e-3, 1e-3], [100, 100], strategy="unequal")
    assert une.sizes.tolist() == [50, 50] and plan_time(une, [0.0, 0.0], [1e-3, 1e-3]) == pytest.approx(une.predicted)
    assert plan_time(une, [0.01, 0.0], [1e-3, 3e-3]) == pytest.approx(0.15)
    acc = plan_step(100, [0.0, 0.0], [1e-3, 1e-3], [100, 100], micro=10, strategy="accumulate", pass_fixed=[1e-3, 1e-3])
    assert plan_time(acc, [0.0, 0.0], [1e-3, 1e-3], pass_fixed=[1e-3, 1e-3]) == pytest.approx(acc.predicted)


def test_no_split_beats_the_step_floor_so_the_balancer_may_skip_a_strategy():
    """step_floor is under every plan either strategy makes (random clusters: stragglers,
    caps, zero fixed parts), and NaN where its bound needs what the fits lack. The
    balancer prices accumulation only where that floor leaves it a chance: its choice
    equals pricing both strategies every time."""
    from hetrain.perf.steptime import step_floor

    rng = np.random.default_rng(3)
    for _ in range(1500):
        n, g = int(rng.integers(1, 6)), int(rng.integers(1, 600))
        fixed = rng.uniform(0, 0.02, n) * (rng.uniform(0, 1, n) < 0.7)
        per = 10 ** rng.uniform(-6, -2, n)
        caps = np.maximum((rng.uniform(0.3, 2, n) * g).astype(np.int64), 1)
        if caps.sum() < g:
            continue
        floor = step_floor(g, fixed, per)
        micro = int(rng.integers(1, 64))
        for plan in (plan_unequal(g, fixed, per, caps), plan_accumulate(g, micro, fixed, per, pass_fixed=fixed),
                     plan_unequal(g, fixed, per, caps, small_share=0.0)):
            assert floor <= plan.predicted * (1 + 1e-12), (floor, plan)
    assert np.isnan(step_floor(10, [-0.001, 0.0], [1e-3, 1e-3])) and np.isnan(step_floor(10, [0.0], [0.0]))

    def choices(skip: bool, other_rows) -> list[str]:
        import hetrain.train.balance as balance
        real = balance.step_floor
        balance.step_floor = real if skip else (lambda *_a: float("nan"))  # NaN: always price both
        try:
            b = Balancer(None, 512, BalanceConfig(overlap_exchange=False, every=1, micro_batch=32),
                         gather=_fake_gather([np.inf, 5, 0, 0, 1], *other_rows), num_workers=2,
                         caps=[512, 40])
            out = []
            for _ in other_rows:
                b.record(int(b.sizes[0]) or 1, 1e-3 + 1e-5 * int(b.sizes[0]))
                b.update()
                out.append((b.plan.strategy, b.sizes.tolist()))
            return out
        finally:
            balance.step_floor = real

    rows = [[f, p] for f, p in zip(rng.uniform(0, 0.003, 40), 10 ** rng.uniform(-6, -3.5, 40))]
    with_skip = choices(True, rows)
    assert with_skip == choices(False, rows)
    assert {s for s, _ in with_skip} == {"unequal", "accumulate"}  # both strategies were taken


def test_shares_ride_out_step_noise_and_follow_a_real_change():
    """StepTimeModel.noise reads the step-to-step noise of a worker's time (8% here) and
    is not fooled by a change of speed, which shortens its level to the steps after it.
    With fits that move by that noise the balancer keeps its split (BalanceConfig.
    hold_noise standard errors of the level), where the fixed 1% hold alone re-split on
    most exchanges; a worker turning 2x slower is followed at once either way."""
    from hetrain.perf.stepfit import StepTimeModel

    rng = np.random.default_rng(5)
    m = StepTimeModel()
    for k in range(16):
        m.add(500, 0.5 * (1 + 0.08 * rng.standard_normal()) * (2.0 if k >= 12 else 1.0))
    m.fit()
    assert 0.04 < m.noise < 0.14, m.noise
    assert m.span == 5 and m.level_error == pytest.approx(1.2533 * m.noise / 5 ** 0.5)  # the change cut the level
    err = 1.2533 * 0.08 / 5 ** 0.5  # the other worker's level: the median of 5 steps with 8% noise
    wobble = [[0.0, 1e-3 * (1 + 0.04 * rng.standard_normal()), err] for _ in range(12)] + [[0.0, 2e-3, err]] * 3

    def sizes(**cfg):
        b = Balancer(None, 1000, BalanceConfig(overlap_exchange=False, every=1, **cfg),
                     gather=_fake_gather([np.inf, 5, 0, 0, 1], *wobble), num_workers=2)
        seen = []
        for _ in wobble:
            b.record(int(b.sizes[0]), 1e-3 * int(b.sizes[0]) * (1 + 0.08 * rng.standard_normal()))
            seen.append(int(b.update()[0]))
        return seen

    noisy, fixed = sizes(), sizes(hold_noise=0.0)
    assert len(set(noisy[1:12])) == 1 and len(set(fixed[1:12])) > 3, (noisy, fixed)
    assert noisy[-1] > 600 and fixed[-1] > 600  # the other worker at half speed: about 667 of 1000 here
    with pytest.raises(UserError, match="hold_noise"):
        BalanceConfig(hold_noise=-1.0)


def test_probe_steps_double_their_wait_and_reset_once_everyone_is_in_for_a_first_wait():
    from hetrain.train.probe import Probe, probe_sizes

    p = Probe(every=4, steps=2)
    due = [(s, k) for s in range(40) if (k := p.due(s, someone_out=True)) is not None]
    assert due == [(4, 0), (5, 1), (14, 0), (15, 1), (32, 0), (33, 1)]  # waits of 4, 8, 16 steps
    # everyone in for less than a first wait (the worker rejoined and left again): still doubling
    assert p.due(40, someone_out=False) is None and p.due(42, someone_out=False) is None and p.gap == 32
    assert [s for s in range(43, 70) if p.due(s, someone_out=True) is not None] == [66, 67]
    # everyone in for a whole first wait: the next worker to leave waits the first gap
    assert all(p.due(s, someone_out=False) is None for s in range(70, 75)) and p.gap == 4 and p.at is None
    assert [s for s in range(75, 85) if p.due(s, someone_out=True) is not None] == [79, 80]
    assert all(Probe(every=0, steps=2).due(s, True) is None for s in range(100))
    sizes = probe_sizes(np.array([300, 0, 100]), np.array([False, True, False]), 40, 1)
    assert sizes.tolist() == [255, 60, 85] and sizes.sum() == 400  # 1.5 x 40, from the others by share


def test_a_probe_on_copies_keeps_the_split_and_says_what_each_worker_out_times():
    """Where workers out leave the exchange (BalancedBatchSampler sets `shadow_probes`), a
    probe step keeps the plan (the others train the whole batch) and `shadow` gives each
    worker out the samples it times a step on, copies, its gradients dropped."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1, probe_every=2),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.05]), num_workers=2)
    b.shadow_probes = True
    b.record(50, 0.05)
    b.update()
    seen = []
    for _ in range(6):
        plan = b.step_plan()
        seen.append((plan.sizes.tolist(), None if b.shadow is None else b.shadow.tolist(), b.probing))
        b.record(int(b.sizes[0]), 1e-3 * int(b.sizes[0]))
        b.update()
    assert all(sizes == [100, 0] for sizes, _, _ in seen), seen
    # as long as the planned step at most (it runs beside it): 2 samples, x1, x1.5, x0.5 in turn
    assert [shadow for _, shadow, probing in seen if probing] == [[0, 2], [0, 3], [0, 1]], seen
    assert all(shadow is None for _, shadow, probing in seen if not probing)


def test_a_worker_that_sat_out_is_measured_again_and_rejoins_once_it_recovers():
    """Worker 1 stalls (200 ms more a pass) and sits out: a worker that trains on no sample
    records no time, so only a probe (a few steps with every worker in, after a wait that
    doubles while it stays out) can see it recover. Two real balancers in lockstep."""
    from hetrain.train.exchange import InProcessExchange

    fixed, per = np.array([1e-3, 1e-3]), np.array([0.1e-3, 0.2e-3])
    cfg = BalanceConfig(probe_every=20)
    ex = InProcessExchange(2)
    bal = [Balancer(None, 300, cfg, gather=ex.gather_for(r), num_workers=2) for r in range(2)]
    rng = np.random.default_rng(11)
    shares = []
    for step in range(140):
        plans = [b.step_plan() for b in bal]
        sizes = plans[0].sizes
        assert sizes.tolist() == plans[1].sizes.tolist()
        stall = np.array([0.0, 0.2 if 10 <= step < 60 else 0.0])
        times = (fixed + stall + per * sizes) * (1 + 0.02 * rng.standard_normal(2))
        for r, b in enumerate(bal):
            b.record(int(sizes[r]), float(times[r]))
        for b in bal:
            b.update()
        shares.append(int(sizes[1]))
    out = [s for s in range(10, 60) if shares[s] == 0]
    assert out and out[0] < 20, shares[:60]  # it left during the stall
    probed = [s for s in range(out[0], 60) if shares[s] > 0]
    assert 1 <= len(probed) <= 3, shares[:60]  # one probe while it stalled, then a doubled wait
    assert all(abs(s - 100) <= 10 for s in shares[125:]), shares[60:]  # back, at its best share (1/3)


def test_a_probe_step_stays_within_about_twice_the_planned_step():
    """A worker 50x slower a sample sits out (its best share is under small_share); its
    probe shares are bounded by what its per-sample fit can do in twice the planned step
    (4, 6 and 2 samples here), not the 10 it would rejoin at (15 samples: 0.75 s against
    a 0.1 s step)."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1, probe_every=2),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.05]), num_workers=2)
    b.record(50, 0.05)  # this worker: 1 ms a sample
    b.update()
    assert b.sizes.tolist() == [100, 0]
    seen = []
    for _ in range(6):
        seen.append(b.step_plan().sizes.tolist())
        b.record(int(b.sizes[0]), 1e-3 * int(b.sizes[0]))
        b.update()
    assert [s for s in seen if s[1] > 0] == [[96, 4], [94, 6], [98, 2]], seen
