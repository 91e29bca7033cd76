"""Measured batch balancing (H-PS): each worker's share of the global batch is chosen so
that all workers are predicted to finish their step's compute together, within what
their memory holds.

A worker's compute time per step is not proportional to its share: there is a fixed
part (kernel launches, Python, the optimizer update, small-batch inefficiency) and a
per-sample part, and both differ per device (a GPU has a large fixed part and a tiny
per-sample part; a CPU the other way round). Every worker therefore fits its own

    t(b) = fixed + per_sample · b

online from its recent steps (`StepTimeModel` in `hetrain.perf.steptime`, the one
step-time model the planner shares), exchanges the two numbers with the other workers
(riding the optimizer's gradient all-reduce where it can, else an all-gather of their
own: train/exchange.py), and every worker runs the same exact solver (`solve_shares`) on
the same numbers, so all agree on the shares without a coordinator. The global batch
never changes, and push_pull weights each gradient by its batch size, so the update is
the one a single machine would compute on the whole global batch.

Memory caps come from the device itself (`hetrain.runtime.memory.memory_limit`: free
GPU memory, or the process's cgroup / RLIMIT_AS / available RAM on a CPU); the cluster
file's `memory` overrides the measurement (what each worker reports at its start:
`balance_devices.py`).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ..errors import UserError
from ..perf.exchangeset import fastest_sets
from ..perf.stepfit import StepTimeModel
from ..perf.steptime import StepPlan, plan_step, plan_time, predicted_times, step_floor
from .balance_config import BalanceConfig
from .balance_devices import DeviceMemoryTooSmallError, DeviceReports, WorkerDevice, memory_caps  # noqa: F401
from .exchange_price import ExchangePrices, leaves_out
from .set_times import SetTimes
from .balance_exchange import FitExchange
from .exchange import Gather, worker_gather
from .probe import Probe, probe_sizes
from .trial import SubsetTrial


class Balancer(FitExchange, DeviceReports):
    """Per-job balancer: `sizes` is this step's batch size for every worker.

    Call `record(samples, seconds)` after each step's compute and `update()` once per
    step (every worker, same step): the step-time fits are exchanged (one all-gather,
    which can carry extra per-step numbers for metrics) and the shares recomputed.

    Construction is a collective too: every worker measures its device's free memory
    (unless the cluster file overrides it) and the limits are exchanged, so all workers
    know every cap; a worker whose device cannot hold the smallest share stops the job
    on every rank with the same message before training starts.
    """

    def __init__(self, ctx, global_batch: int, cfg: BalanceConfig | None = None, memory: list[float] | None = None,
                 device: torch.device | None = None, caps=None, gather: Gather | None = None,
                 num_workers: int | None = None, labels: list[str] | None = None, lockstep: bool = True):
        self.ctx = ctx
        self.lockstep = lockstep  # False (async training): no per-step exchange, shares stay as they are
        self.cfg = cfg or BalanceConfig()
        self.n = num_workers or ctx.num_workers
        self.global_batch = int(global_batch)
        if global_batch < 1:
            raise UserError(f"global_batch must be >= 1 sample, got {global_batch}")
        self._gather = gather or worker_gather(ctx, "exchanging measured step times")
        topo = ctx.topology if ctx is not None else None
        self.labels = labels or (list(topo.worker_labels) if topo else [f"w{i}" for i in range(self.n)])
        self.device = device or torch.device("cpu")
        self.devices = self._exchange_devices(memory)
        mem_caps = memory_caps([d.memory for d in self.devices], self.cfg, self.global_batch)
        self._check_smallest_share(mem_caps)
        if caps is not None:  # the user's own limits, on top of what memory allows
            if len(caps) != self.n or any(int(c) < 0 for c in caps):
                raise UserError(f"max_samples needs one limit >= 0 per worker ({self.n}), got {list(caps)}")
            mem_caps = np.minimum(mem_caps, np.asarray(caps, dtype=np.int64))
        self.caps = np.minimum(mem_caps, self.global_batch)
        self.model = StepTimeModel(self.cfg.window, self.cfg.recent)
        self.fits = np.full((self.n, 2), np.nan)  # agreed (fixed, per_sample) per worker
        self.level_error = np.zeros(self.n)  # agreed standard error of each worker's fitted level (relative)
        # each worker's exchange seconds, agreed, and what they price (train/exchange_price.py)
        self.prices = ExchangePrices(self.n, self.cfg.window)
        self.set_times = SetTimes(self.n, self.cfg.window)  # each set's measured step (train/set_times.py)
        self.probing = False  # the step planned last is a probe step (its split is not its set's)
        # a probe's workers out time a step on copies of samples, out of the exchange (`step_plan`;
        # BalancedBatchSampler sets it where workers out leave the exchange), and how many
        self.shadow_probes = False
        self.shadow: np.ndarray | None = None
        self._partial: dict[int, StepPlan] = {}  # plans of smaller batches (an epoch's last) for these fits
        self._last_partial: dict[int, StepPlan] = {}  # the split last used for such a batch (held, see _held)
        self.rows: np.ndarray | None = None  # the extra numbers of the last exchange applied
        self.rows_step = 0  # the update (1-based step) those numbers belong to
        self._pending = None  # (wait, step) of the exchange in flight (overlap_exchange)
        self._alone_every = self.cfg.window  # steps between exchanges while one trains alone (_alone_cadence)
        # carry(row) -> Cargo | None: the rows ride the optimizer's next all-reduce instead
        # of a gather of their own (comm/cargo.py; set by the loader, on the job's workers)
        self.carry: Callable | None = None
        self._prefetched = False  # the exchange in flight was completed and applied by prefetch()
        self.step = 0
        self.carried = 0  # exchanges whose rows rode the optimizer's all-reduce (train/exchange.py)
        self.every_worker = False  # every worker keeps a share (see require_every_worker)
        self.micro = self.cfg.micro_batch or max(1, self.global_batch // (2 * self.n))
        self.strategy = "unequal" if self.cfg.strategy == "auto" else self.cfg.strategy  # until measured
        self.probe = Probe(self.cfg.probe_every, -(-self.cfg.recent // 2))  # when a worker sitting out trains
        # when a set of several gives way to a subset never measured (train/trial.py): the
        # first time after a window of its measured steps, off where probes are
        self.trial = SubsetTrial(self.cfg.window if self.cfg.probe_every else 0, 4 * self.cfg.window)
        self.plan: StepPlan | None = None  # the full batch's current plan (none while the first is made)
        self.plan = self.plan_for(self.global_batch)
        self.sizes = self.plan.sizes
        self.history: list[np.ndarray] = [self.sizes.copy()]

    def require_every_worker(self, why: str) -> None:
        """From now on every worker gets at least one sample per step: none is dropped as
        too slow to help. For batches that cannot be empty (`why`: a DataLoader cannot
        collate an empty batch). Every worker must call it at the same point (the shares
        stay agreed); a worker capped at 0 samples cannot comply and stops the job."""
        out = [lab for lab, c in zip(self.labels, self.caps) if c < 1]
        if out:
            raise UserError(f"{why}, but worker(s) {', '.join(out)} may take no sample (max_samples=0, or a device "
                            "that cannot hold one): raise their limit, or use hetrain.BalancedLoader, whose workers "
                            "can sit a step out")
        if not self.every_worker:
            self.every_worker = True
            self._partial.clear()
            self.plan = self.plan_for(self.global_batch)
            self.sizes = self.plan.sizes

    # -- per step: the shares (recording and exchanging the fits: balance_exchange.FitExchange)
    def shares_for(self, total: int) -> np.ndarray:
        """Shares of `total` samples (the global batch, or an epoch's last partial batch)
        from the agreed fits; equal (capped) before any measurement. No collective."""
        return self.plan_for(total).sizes

    def plan_for(self, total: int) -> StepPlan:
        """How `total` samples are split (`hetrain.perf.steptime.plan_step`): the strategy
        chosen, each worker's samples and, accumulating, its count of micro-batches.

        With strategy "auto" the faster strategy for the agreed fits is taken, and kept
        until the other is predicted 5% faster (no flapping on noise). A micro-batch
        pays the step's fixed part again (kernel launches, Python), so accumulation is
        predicted slower unless memory caps the unequal batches. The split in use is kept
        unless the new one is predicted faster by more than `hold` (`_held`): where the
        split in use is within `hold` of `step_floor`, no split of either strategy can be,
        and nothing is solved (most re-balances once shares settle: solving inside the
        step cost a few hundred microseconds of it on a busy core)."""
        if int(total) != self.global_batch and int(total) in self._partial:
            return self._partial[int(total)]  # an epoch's last batch, planned with these fits already
        fixed, per, measured = self._fixed_per()
        current = self.plan if int(total) == self.global_batch else self._last_partial.get(int(total))
        floor = step_floor(total, fixed, per) if measured else float("nan")  # no split is predicted faster
        if measured and self._near_floor(current, floor, fixed, per):
            plan = current
        else:
            plan = self._solve(int(total), np.asarray(fixed), np.asarray(per), measured, current, floor)
        if int(total) != self.global_batch:
            self._partial[int(total)] = self._last_partial[int(total)] = plan
        return plan

    def _fixed_per(self) -> tuple[list[float], list[float], bool]:
        """The agreed fits as plain floats (numpy's per-call cost, in the step), a worker
        not measured yet counted as the measured ones' mean; and whether any is measured."""
        fits = self.fits.tolist()
        known = [f for f in fits if math.isfinite(f[1])]
        if self.cfg.policy == "equal" or not known:
            return [0.0] * self.n, [1.0] * self.n, False
        fill = [sum(f[0] for f in known) / len(known), sum(f[1] for f in known) / len(known)]
        fixed, per = ([(f if math.isfinite(f[1]) else fill)[k] for f in fits] for k in (0, 1))
        return fixed, per, True

    def step_plan(self) -> StepPlan:
        """The split of the next full-batch step (call once a step, every worker): `plan`,
        or, on a probe step (`train/probe.py`), the same with every worker sitting out
        given the share it would rejoin at (unequal batches; an accumulating plan's
        workers out stay out). With `shadow_probes` a probe step keeps `plan` and says in
        `shadow` how many samples each worker out times a step on, copies of the batch's,
        its gradients dropped: it stays out of the exchange, the others' step unchanged."""
        plan, self.shadow = self.plan, None
        if self.solo:  # no worker to probe (FitExchange.solo)
            return plan
        out = (plan.sizes == 0) & (self.caps > 0)
        k = self.probe.due(self.step, bool(out.any())) if self.lockstep and plan.strategy == "unequal" else None
        self.probing = k is not None
        if k is None:
            return plan
        if k == 0:  # the sets these workers would rejoin are priced by prediction again
            self.set_times.forget(out)
        # the share it would rejoin at, or less where its per-sample fit alone would make
        # the probe step more than twice the planned one (a CPU beside GPUs), at least 2
        rejoin = self.cfg.rejoin * max(self.cfg.small_share, 0.05) * self.global_batch / self.n
        per = np.where(np.isfinite(self.fits[:, 1]) & (self.fits[:, 1] > 0), self.fits[:, 1], np.inf)
        # (on copies, beside the others' step: as long as it, at most, where they share cores)
        reach = 1.0 if self.shadow_probes else 2.0
        share = np.clip(reach * plan.predicted / per, 2, rejoin) if np.isfinite(plan.predicted) else rejoin
        sizes = np.minimum(probe_sizes(plan.sizes, out, share, k), self.caps)
        if self.shadow_probes:
            self.shadow = np.where(out, sizes, 0)
            return plan
        sizes[np.argmax(self.caps - sizes)] += self.global_batch - int(sizes.sum())  # what a cap cut
        return StepPlan("unequal", sizes, 0, (sizes > 0).astype(np.int64), plan.predicted)

    def _near_floor(self, current: StepPlan | None, floor: float, fixed: list[float], per: list[float]) -> bool:
        """The split in use stays without a solve: predicted within `hold` of the floor no
        split beats (`step_floor`), so `_held` would keep it against any new one."""
        hold = self.hold
        if current is None or hold <= 0 or (self.every_worker and bool((current.sizes == 0).any())):
            return False
        if self._priced(current.sizes.sum()):  # a smaller set is kept within `cfg.hold` only (`_held`)
            members = current.sizes > 0
            if self.set_times.better(members, self.step) is not None:
                return False  # another set ran measurably faster (train/set_times.py): solve, and take it
            if self.trial.due(self.rows_step, members, self._measured(members)):
                return False  # a subset is on trial, or may go on trial now (train/trial.py): solve
            floor = self.prices.floor(current.sizes.sum(), fixed, per, self.caps, floor)
            hold = min(hold, self.cfg.hold)
        return self._price(current, fixed, per) <= floor * (1 + hold)

    def _measured(self, members) -> bool:
        """Whether the set `members` (bool mask) has a measured step (train/set_times.py)."""
        return math.isfinite(self.set_times.time(members, self.step))

    def _priced(self, total) -> bool:
        """Whether the exchange is priced when the full batch's workers are chosen
        (`hetrain.perf.exchangeset`): they leave the exchange at share 0 and some measured it."""
        return self.cfg.leave and int(total) == self.global_batch and not self.every_worker and self.prices.measured

    def _price(self, plan: StepPlan, fixed, per) -> float:
        """Predicted seconds of `plan`'s step under these fits: its compute, and where
        the exchange is priced, the exchange among its workers."""
        return self.prices.price(plan, fixed, per) if self._priced(plan.sizes.sum()) else plan_time(plan, fixed, per)

    def _solve(self, total: int, fixed: np.ndarray, per: np.ndarray, measured: bool,
               current: StepPlan | None, floor: float) -> StepPlan:
        """`plan_for`'s solve: the strategy's split (both priced with "auto"), then `_held`."""
        caps = np.minimum(self.caps, total)
        if self.cfg.leave and int(total) < self.global_batch and not self.every_worker and self.plan is not None:
            caps = np.where(self.plan.sizes > 0, caps, 0)  # an epoch's last batch: no worker rejoins for it
        micro = min(self.micro, int(total))
        # accumulation only needs one micro-batch in memory: a worker that cannot hold it runs none
        micro_caps = np.where((self.caps >= micro) & (caps > 0), int(total), 0)
        # an epoch's last partial batch keeps every worker: one short step's fixed part is
        # the fits' least certain number, and a data loader cannot be handed an empty batch
        keep = self.every_worker  # a DataLoader's batches: nobody sits out (require_every_worker)
        args = dict(micro=micro, micro_caps=micro_caps, pass_fixed=fixed,
                    min_samples=max(1, self.cfg.min_samples) if keep else self.cfg.min_samples,
                    labels=self.labels, memory_per_sample=self.cfg.memory_per_sample,
                    drop=int(total) == self.global_batch and not keep, small_share=self._small_share())
        if self.cfg.strategy != "auto" or not measured or int(total) != self.global_batch:
            # (an epoch's last partial batch keeps the strategy chosen for the full ones)
            plan = plan_step(int(total), fixed, per, caps, strategy=self.strategy, **args)
        else:
            une = plan_step(int(total), fixed, per, caps, strategy="unequal", **args)
            if self.strategy == "unequal" and floor * (1 - 1e-9) >= 0.95 * une.predicted:
                plan = une  # accumulation cannot beat it by 5%: no need to solve it (step_floor)
            else:
                acc = plan_step(int(total), fixed, per, caps, strategy="accumulate", **args)
                cur, other = (une, acc) if self.strategy == "unequal" else (acc, une)
                plan = other if other.predicted < 0.95 * cur.predicted else cur
            self.strategy = plan.strategy
        if measured and self._priced(total):
            solve = lambda m: plan_step(total, fixed, per, np.where(m, caps, 0), strategy=plan.strategy,  # noqa: E731
                                        **{**args, "micro_caps": np.where(m, micro_caps, 0)})
            plan = self.prices.best(plan, total, fixed, per, caps, solve)
            faster = self.set_times.better(plan.sizes > 0, self.step)
            if faster is not None:  # its set ran measurably slower, recently, than another set did
                plan = solve(faster)
                if current is None or not bool(((current.sizes > 0) == (plan.sizes > 0)).all()):
                    return plan  # measured faster, where the fits say otherwise: not held against them
            if int(total) == self.global_batch:  # a subset never measured, on trial (train/trial.py)
                trial = self.trial.propose(self.rows_step, plan.sizes > 0, self._measured(plan.sizes > 0),
                                           fastest_sets(total, fixed, per, caps), self._measured)
                if trial is not None:
                    return solve(trial)
        if plan.sizes.sum() != total:  # pragma: no cover - the solvers guarantee it
            raise RuntimeError(f"balancer split {total} samples into {plan.sizes.tolist()}")
        return self._held(current, plan, fixed, per) if measured else plan

    def _held(self, current: StepPlan | None, new: StepPlan, fixed: np.ndarray, per: np.ndarray) -> StepPlan:
        """`current` (the split in use for this many samples) unless `new` is predicted
        faster, under the same fits, by more than `hold` of the step (BalanceConfig.hold:
        a new local batch size costs kernels built per shape). Every worker decides the
        same from the same agreed fits. Where the exchange is priced, a new split that leaves
        workers out of the set in use (and takes in none) saves their exchange, which the fits' noise says nothing
        of: it needs to beat `cfg.hold`, or where the exchange it saves was measured
        noisy, `hold_noise` standard errors of its price (`ExchangePrices.error`): leave
        as soon as the exchange's own measurements say so, not on a spike of a loaded
        host, and rejoin only well above the fits' noise (as `rejoin` does for small shares)."""
        hold = self.hold
        if current is not None and self._priced(new.sizes.sum()) and leaves_out(current, new):
            noise = self.prices.error(current.sizes > 0) / max(self._price(current, fixed, per), 1e-12)
            hold = max(self.cfg.hold, self.cfg.hold_noise * noise)
        if (current is None or hold <= 0 or current.strategy != new.strategy or current.micro != new.micro
                or (self.every_worker and bool((current.sizes == 0).any()))):
            return new
        return current if self._price(current, fixed, per) <= self._price(new, fixed, per) * (1 + hold) else new

    @property
    def hold(self) -> float:
        """How much faster a new split must be predicted: `BalanceConfig.hold`, or, where
        the fits are noisier, `hold_noise` standard errors of the noisiest worker's level
        (`StepTimeModel.level_error`: its step-to-step noise over the steps its level is
        the median of, up to the window while its speed holds): a split re-solved on
        noise alone is no faster, and each new one is a new input shape; a real change of
        speed moves the prediction far more."""
        if self.cfg.hold <= 0:
            return 0.0
        return max(self.cfg.hold, self.cfg.hold_noise * float(np.max(self.level_error)))

    def _small_share(self) -> list[float]:
        """Each worker's small-share threshold: `small_share`, or `rejoin` times it for a
        worker the current plan leaves out (hysteresis: see BalanceConfig.rejoin)."""
        out = self.plan.sizes == 0 if self.plan is not None else np.zeros(self.n, dtype=bool)
        return [self.cfg.small_share * (self.cfg.rejoin if o else 1.0) for o in out]

    def predicted(self, sizes=None) -> np.ndarray:
        """Predicted compute seconds per worker for `sizes` (default: this step's)."""
        sizes = self.sizes if sizes is None else sizes
        return predicted_times(sizes, self.fits[:, 0], self.fits[:, 1])
