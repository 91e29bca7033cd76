"""Real-compute cases of `bench/hetero.py`: hetrain against PyTorch DDP, both overlapping
their bucketed all-reduce with backward, on even and uneven workers (bench/real_worker.py).

Per model (MLP, CNN, small transformer; 2 workers, a core each):
  even      equal work: hetrain equal shares vs DDP. `even_over_ddp`: median over
            interleaved repeats of hetrain's samples/s / DDP's in the same repeat.
  uneven    worker 1 runs `SLOW` extra forward passes (real compute, backward once):
            DDP (equal shares), hetrain "unequal" (local batches by speed) and
            "accumulate" (equal micro-batches of MICRO, a count per worker), and
            "tail" (unequal, with TAIL of every step claimed while it runs, in about
            TAIL_CHUNKS chunks per worker: hetrain.train.tail; `arrival_skew_ms` is
            the mean gap between the workers' ends of backward, `later_worker_wait_ms`
            what a step waits for its slower worker's compute, `step_noise` its
            compute's robust relative sd step to step, `behind_ideal_step_ms`
            how far its step is from the ideal one), and "ddp-static":
            PyTorch DDP given the best fixed shares for the speeds measured before
            the repeat (an oracle: what balancing reaches with DDP's own exchange
            and no balancer, so a gap to the ideal that static DDP shares too is the
            host's, not hetrain's). The ideal
            comes from the workers' speeds measured in each repeat before and after its
            runs, per worker the faster of the two (`repeat_speeds`; how far apart
            they were is `speed_apart_repeats`): forward+backward alone, all workers
            at once and for the same span of time, at half, one and one and a half
            equal shares, fitted as fixed + slope x samples; the speeds seen inside
            hetrain's runs are recorded beside, `per_sample_s_in_run`): DDP's measured
            step minus the compute that perfect balancing saves (`compute_saved`: the
            slowest worker's compute at equal shares, by the fits or as measured in
            DDP's run, whichever is less, minus all workers finishing together by the
            fits), averaged over the measured steps at each one's own global batch
            (`saved_per_step`: every third is an epoch's partial last batch), so
            exchange and overheads stay DDP's. `balanced_over_ideal` =
            (median hetrain/DDP - 1) / (median ideal - 1). Beside it, `noise_bound`:
            the ideal less what the step-to-step noise of hetrain's own unequal steps
            costs the best fixed split (bench/hetero_noise.py), the most fixed shares
            of any kind reach on this host.
  pairing   DDP and hetrain train side by side in one launch, their steps alternating
            (ABBA), so a host whose speed drifts (this one's does, by up to 3x over
            minutes) slows both alike; repeats start fresh models. On uneven work each
            hetrain strategy has a launch of its own (with DDP and static DDP), and its
            ideal and ratios come from that launch.
  accuracy  test accuracy after the same samples vs one process on the same global
            batches (same seeds, one thread): the mean over the last 4 evaluations (every
            5 steps; `single_process_accs` says why not one step's), the last step's
            beside, and time to a target accuracy per system.
Beside: the MLP's even case again with DDP's bucket plan kept (`--buckets ddp`): the
baseline of hetrain's bucket tuning. Shared cores: 3 workers on the host's cores (MLP),
reported beside (full run only).
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from hetero_noise import noise_penalty, step_noise
from real_worker import acc_of, balanced_finish, make_model
from hetrain.demo.digits import load_digits_split
from hetrain.train.sampler import GlobalBatchSampler

MODELS = ("mlp", "cnn", "transformer")
SLOW = 3  # extra forward passes on the slow worker (about 2x its forward+backward)
TARGET = 0.85
MICRO = 64  # accumulate's micro-batch: 8 per global batch of 512
STRATEGIES = ("balanced", "accumulate", "tail")  # hetrain's uneven-work kinds, a launch each
TAIL, TAIL_CHUNKS = 0.2, 2  # the tail kind's share of each step claimed while it runs, chunks per worker


def _steps(run: dict, skip: int) -> np.ndarray:
    """Phases of the measured steps (ranks x steps x fields): those the span from the end of
    step `skip` to the end of the last one covers."""
    return np.asarray(run["phases"], dtype=float)[:, skip + 1:, :]


def _sps(run: dict, gb: int, skip: int) -> float:
    """Samples per second over the measured steps: the samples the workers trained on (an
    epoch's last global batch is partial: 233 of the digits' 1257 training images at 512),
    or `gb` per step for a run without per-step phases."""
    t = np.asarray(run["times"])
    samples = _steps(run, skip)[:, :, 5].sum() if "phases" in run else gb * (len(t) - 1 - skip)
    return float(samples / (t[-1] - t[skip]))


def _step_s(runs: list[dict], skip: int) -> np.ndarray:
    """Each run's mean step (seconds) over its measured steps."""
    return np.asarray([(r["times"][-1] - r["times"][skip]) / (len(r["times"]) - 1 - skip) for r in runs])


def _of_ideal(gain, ideal) -> float:
    """The gain over DDP as a fraction of the ideal gain, from the medians over repeats (a
    repeat whose ideal gain is near 0 would make its own fraction meaningless)."""
    return (float(np.median(gain)) - 1) / max(float(np.median(ideal)) - 1, 1e-9)


def _time_to(run: dict, target: float):
    return next((t for _s, t, acc in run["accs"] if acc >= target), None)


EVAL_EVERY = 5  # steps between test-accuracy evaluations (workers and the single process alike)
LAST_EVALS = 4  # the accuracy compared: the mean over the last evaluations (see single_process_accs)


def single_process_accs(model: str, gb: int, steps: int, lr: float, rep: int) -> dict[int, float]:
    """One process on the same global batches (the loader's order for seed `rep`), on one
    thread as each worker runs: test accuracy every EVAL_EVERY steps, by step. Compared
    over the last LAST_EVALS evaluations, not at one step: early in training a model's
    test accuracy can swing by points from one step to the next (the CNN at 40 steps:
    0.84, 0.81, 0.84, 0.79), and the same global batch summed in another order (two
    workers' shares) moves a single step's figure by about as much."""
    xtr, ytr, xte, yte = load_digits_split()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = make_model(model, 100 + rep)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        sampler = GlobalBatchSampler(len(xtr), gb, 1, seed=rep)
        step, epoch, accs = 0, 0, {}
        while step < steps:
            order = sampler.order(epoch)
            for s in range(-(-len(order) // gb)):
                idx = torch.from_numpy(order[s * gb:(s + 1) * gb])
                opt.zero_grad()
                F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
                opt.step()
                step += 1
                if step % EVAL_EVERY == 0:
                    accs[step] = acc_of(net, xte, yte)
                if step >= steps:
                    break
            epoch += 1
        return accs
    finally:
        torch.set_num_threads(threads)


def late_accuracy(accs: dict[int, float]) -> float:
    """Mean test accuracy over the last LAST_EVALS evaluations."""
    last = sorted(accs)[-LAST_EVALS:]
    return float(np.mean([accs[s] for s in last]))


def _run_speeds(res: dict, skip: int) -> np.ndarray:
    """Each worker's seconds per sample of forward+backward, measured inside hetrain's
    balanced runs (interleaved with DDP's, so under the same load; hetrain's backward
    excludes the wait for the last bucket, which DDP's backward includes): the median
    over steps and repeats of (forward + backward) / samples."""
    per = []
    for r in res["runs"]:
        if r["kind"] not in STRATEGIES:
            continue
        ph = np.asarray(r["phases"], dtype=float)[:, skip:, :]  # ranks x steps x (pre, f, b, sync, upd, n)
        n = ph[:, :, 5]
        per.append(np.where(n > 0, (ph[:, :, 1] + ph[:, :, 2]) / np.maximum(n, 1), np.nan))
    return np.nanmedian(np.concatenate(per, axis=1), axis=1)


def compute_saved(fixed: np.ndarray, slope: np.ndarray, gb: int, equal: float | None = None) -> float:
    """Compute per step that perfect balancing saves against equal shares, for workers
    whose forward+backward takes fixed + slope x samples (measured with every worker
    computing, as they all do under balanced shares): the best shares finish together at
    T with Σ (T - fixed_i) / slope_i = B (a worker whose fixed part alone exceeds T sits
    out). Equal shares finish when the slowest worker does, max_i t_i(B/n) by the fits, or
    `equal` (its forward+backward as measured in DDP's own run) when that is less. Both
    over-count that compute: the fits charge every worker computing at once, while under
    DDP the fast ones wait for the slow one, which then computes faster (up to 1.5x on
    this host); DDP's measured backward includes its exchange. The smaller is the
    tighter bound, and the saving stays an upper bound (the ideal stays optimistic)."""
    n = len(fixed)
    fitted = float(np.max(fixed + slope * gb / n))
    equal = fitted if equal is None else min(equal, fitted)
    return equal - balanced_finish(fixed, slope, gb)[0]


def saved_per_step(fixed: np.ndarray, slope: np.ndarray, ddp_run: dict, skip: int) -> float:
    """`compute_saved` averaged over the steps DDP's run measured, each at its own global
    batch: an epoch's last batch is partial (233 samples every third step here), and
    balancing saves less on it than on a full one (fixed parts weigh more). Per batch
    size, `equal` is the median over its steps of the slowest rank's forward+backward in
    DDP's run (its backward ends with the wait for the last bucket, a small over-count)."""
    ph = _steps(ddp_run, skip)
    batch = ph[:, :, 5].sum(axis=0)
    slowest = np.max(ph[:, :, 1] + ph[:, :, 2], axis=0)
    total = 0.0
    for b in np.unique(batch):
        at = batch == b
        total += int(at.sum()) * compute_saved(fixed, slope, int(b), float(np.median(slowest[at])))
    return total / len(batch)


def _slowest_compute(run: dict, skip: int) -> float:
    """The slowest rank's forward+backward per step in a DDP run (median over steps)."""
    ph = _steps(run, skip)
    return float(np.max(np.median(ph[:, :, 1] + ph[:, :, 2], axis=1)))


def _skew(run: dict, skip: int) -> float:
    """Mean over measured steps of the gap between the first and the last worker's end of
    backward (the host's monotonic clock, comparable across the workers of one host)."""
    t3 = _steps(run, skip)[:, :, 8]
    return float(np.mean(t3.max(axis=0) - t3.min(axis=0)))


def _later_wait(run: dict, skip: int) -> float:
    """Mean over measured steps of the slowest worker's forward+backward minus the workers'
    mean: what a step waits for its later worker when the shares are right on average but
    each worker's compute varies from step to step (shares fixed before a step cannot
    remove it, and the fitted ideal does not count it). hetrain's kinds only: DDP's
    backward includes its wait for the other worker."""
    ph = _steps(run, skip)
    fb = ph[:, :, 1] + ph[:, :, 2]
    return float(np.mean(fb.max(axis=0) - fb.mean(axis=0)))


def _per_repeat(res: dict, kind: str) -> list[dict]:
    return [r for r in res["runs"] if r["kind"] == kind]  # the worker runs repeats in order


SPEED_DISAGREE = 0.10  # before/after speed measurements further apart than this are reported


def repeat_speeds(speed_runs: list[dict], repeats: int) -> tuple[list[dict], list[float]]:
    """Each repeat's worker speeds, from the measurements before and (where taken) after
    its runs: per worker, the fit of the faster measurement (per sample at the equal
    share). A host slowdown only ever slows a measurement, and one that lands in a single
    measurement (this host's speed drifts by up to 3x over minutes) would make that
    worker look slower than it trains, and the ideal too low or too high. Also, per
    repeat, how far apart the two were (max over workers of |before / after - 1|; 0 with
    one measurement), which says how far the ideal can be trusted."""
    per = len(speed_runs) // max(repeats, 1)
    out, apart = [], []
    for k in range(repeats):
        ms = speed_runs[k * per:(k + 1) * per]
        t = np.asarray([m["per_sample_s"] for m in ms])  # measurements x workers
        pick = np.argmin(t, axis=0)
        out.append({key: [ms[pick[w]][key][w] for w in range(t.shape[1])]
                    for key in ("per_sample_s", "fixed_s", "slope_s")})
        apart.append(float(np.max(np.abs(t[0] / t[-1] - 1))))
    return out, apart


def even_case(res_even: dict, gb: int, skip: int) -> dict:
    """hetrain with equal shares against DDP, paired in one launch: samples/s of each and
    `even_over_ddp`, the median over repeats of the per-repeat ratio."""
    ev_d, ev_h = _per_repeat(res_even, "ddp"), _per_repeat(res_even, "even")
    ratios = [_sps(h, gb, skip) / _sps(d, gb, skip) for h, d in zip(ev_h, ev_d)]
    return {"even": {"ddp_samples_per_s": float(np.median([_sps(r, gb, skip) for r in ev_d])),
                     "hetrain_samples_per_s": float(np.median([_sps(r, gb, skip) for r in ev_h])),
                     "ratio_repeats": ratios},
            "even_over_ddp": float(np.median(ratios))}


def summarize(res_even: dict, res_uneven: dict, gb: int, skip: int) -> dict:
    out: dict = even_case(res_even, gb, skip)
    # each repeat's speeds, measured before and after its runs (all workers computing at once)
    ddp = _per_repeat(res_uneven, "ddp")
    speed_runs, apart = repeat_speeds(_per_repeat(res_uneven, "speed"), len(ddp))
    speeds = np.asarray([r["per_sample_s"] for r in speed_runs])
    equal = [_slowest_compute(r, skip) for r in ddp]
    saved = np.asarray([saved_per_step(np.asarray(r["fixed_s"]), np.asarray(r["slope_s"]), d, skip)
                        for r, d in zip(speed_runs, ddp)])
    ddp_step = _step_s(ddp, skip)
    ideal = ddp_step / np.maximum(ddp_step - saved, 1e-9)
    out["uneven"] = {"per_sample_s": np.median(speeds, axis=0).tolist(),
                     "fixed_s": np.median([r["fixed_s"] for r in speed_runs], axis=0).tolist(),
                     "slope_s": np.median([r["slope_s"] for r in speed_runs], axis=0).tolist(),
                     "per_sample_s_in_run": _run_speeds(res_uneven, skip).tolist(),
                     "equal_compute_ddp_s": float(np.median(equal)), "compute_saved_s": float(np.median(saved)),
                     "ideal_over_ddp": float(np.median(ideal)),
                     "ideal_repeats": ideal.tolist(),
                     "speed_apart_repeats": apart,
                     "ddp_samples_per_s": float(np.median([_sps(r, gb, skip) for r in ddp]))}
    for kind in ("balanced", "accumulate", "tail", "ddp-static"):
        runs = _per_repeat(res_uneven, kind)
        if not runs:
            continue
        gain = np.asarray([_sps(h, gb, skip) / _sps(d, gb, skip) for h, d in zip(runs, ddp)])
        frac = (gain - 1) / np.maximum(ideal[:len(gain)] - 1, 1e-9)
        over_ideal = _of_ideal(gain, ideal)  # the per-repeat fractions are kept beside
        shares = np.mean([np.mean(np.asarray(r["sizes"], dtype=float)[skip:], axis=0) for r in runs], axis=0)
        step = _step_s(runs, skip)
        behind = step - (ddp_step / ideal)[:len(step)]  # this system's step minus the ideal step, per repeat
        out["uneven"][kind] = {"samples_per_s": float(np.median([_sps(r, gb, skip) for r in runs])),
                               "over_ddp": float(np.median(gain)), "over_ideal": over_ideal,
                               "over_ideal_repeats": frac.tolist(), "mean_shares": [round(float(v), 1) for v in shares],
                               "final_acc": float(np.median([r["final_acc"] for r in runs])),
                               "arrival_skew_ms": float(np.mean([_skew(r, skip) for r in runs]) * 1e3),
                               "later_worker_wait_ms": float(np.median([_later_wait(r, skip) for r in runs]) * 1e3),
                               "behind_ideal_step_ms": float(np.median(behind) * 1e3),
                               "step_noise": float(np.median([step_noise(_steps(r, skip)) for r in runs])),
                               # the loader's own exchange (fits all-gather, re-plan) per step, this rank's
                               "exchange_ms_per_step": float(np.median([r.get("loader_exchange_s", 0.0)
                                                                        / len(r["times"]) for r in runs]) * 1e3),
                               "speed_apart_max": max(apart, default=0.0)}  # of this launch's ideal
    if "balanced" in out["uneven"]:
        out["balanced_over_ideal"] = out["uneven"]["balanced"]["over_ideal"]
        pen = [noise_penalty(_steps(h, skip), s["fixed_s"], s["slope_s"])
               for h, s in zip(_per_repeat(res_uneven, "balanced"), speed_runs)]
        if pen and None not in pen:  # the ideal with the noise of hetrain's own steps: no fixed split beats it
            bound = ddp_step[:len(pen)] / (ddp_step[:len(pen)] / ideal[:len(pen)] + np.asarray(pen))
            out["uneven"]["noise_bound"] = {"penalty_ms": float(np.median(pen) * 1e3),
                                            "over_ddp": float(np.median(bound)), "over_ideal": _of_ideal(bound, ideal)}
    if "accumulate" in out["uneven"]:
        out["accumulate_over_ideal"] = out["uneven"]["accumulate"]["over_ideal"]
    if "ddp-static" in out["uneven"]:
        out["static_over_ideal"] = out["uneven"]["ddp-static"]["over_ideal"]
    tta = {}
    for kind in ("ddp", *STRATEGIES):
        if not _per_repeat(res_uneven, kind):
            continue
        ts = [_time_to(r, TARGET) for r in _per_repeat(res_uneven, kind)]
        ts = [t for t in ts if t is not None]
        tta[kind] = float(np.median(ts)) if ts else None
    out["time_to_acc_s"] = {**tta, "target": TARGET}
    out["ddp_final_acc"] = float(np.median([r["final_acc"] for r in ddp]))
    return out


def run_cases(launch, tmp, quick: bool) -> dict:
    """`launch(tag, cluster, worker_args)` runs bench/real_worker.py on a cluster and returns its JSON."""
    # hetrain tunes its all-reduce buckets in its first 22 steps (comm/buckets.py): both
    # systems skip those steps as warm-up, and the steady state after them is measured
    # 32 measured steps a repeat in --quick: at 16 (40 steps) one repeat's hetrain/DDP ratio on
    # even work swung 0.91 to 1.07 on this host, where 6 repeats of 76 gave a median of 0.999
    steps, skip, reps = (56, 24, 4) if quick else (80, 26, 7)
    # lr 0.05 (momentum 0.9): at 0.1 the transformer stays at chance for 40 steps and the
    # CNN's accuracy turns on rounding (the same batches as 8 micro-batches: 0.865 against
    # 0.789 whole at step 40); at 0.05 both match one process to 3 decimals at every evaluation
    gb, lr = 512, 0.05
    load0 = os.getloadavg()
    pinned = {"name": "real", "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": 1.0},
                                            "threads": 1} for i in range(2)]}
    common = ["--global-batch", str(gb), "--steps", str(steps), "--repeats", str(reps), "--lr", str(lr),
              "--micro-batch", str(MICRO)]
    out: dict = {"steps": steps, "skip": skip, "repeats": reps, "global_batch": gb, "slow_extra_forwards": SLOW,
                 "micro_batch": MICRO,
                 "cores": len(os.sched_getaffinity(0)), "target_acc": TARGET}
    for model in MODELS:
        print(f"  real {model}: even (hetrain equal shares vs DDP), then uneven", flush=True)
        even = launch(f"real-{model}-even", pinned, ["--model", model, "--kinds", "ddp+even", *common])
        # each hetrain strategy in a launch of its own, beside DDP and static DDP: a job runs
        # one strategy, and strategies alternating in one process would share its exchange
        # group, whose asynchronous work (the balancer's all-gather of fits runs into the
        # next step) lands in another strategy's step
        uneven = {k: launch(f"real-{model}-{k}", pinned,
                            ["--model", model, "--kinds", f"speed,ddp+{k}+ddp-static,speed", "--slow", f"0,{SLOW}",
                             "--eval-every", str(EVAL_EVERY), "--tail", str(TAIL), "--tail-chunks", str(TAIL_CHUNKS),
                             *common]) for k in STRATEGIES}
        case = summarize(even, uneven["balanced"], gb, skip)
        for k in STRATEGIES[1:]:  # each with the ideal and DDP of its own launch
            own = summarize(even, uneven[k], gb, skip)
            u = own["uneven"]
            case["uneven"][k] = {**u[k], "ideal_over_ddp": u["ideal_over_ddp"],
                                 "ddp_samples_per_s": u["ddp_samples_per_s"]}
            case[f"{k}_over_ideal"] = u[k]["over_ideal"]
            case["time_to_acc_s"][k] = own["time_to_acc_s"][k]
        single = single_process_accs(model, gb, steps, lr, reps - 1)
        case["single_process_acc"] = late_accuracy(single)
        runs = {k: next(r for r in uneven["balanced" if k == "ddp" else k]["runs"] if r["kind"] == k
                        and r["rep"] == reps - 1)
                for k in ("ddp", "balanced", "accumulate")}  # the last repeat: same seed as the single process
        case["acc_same_samples"] = {k: late_accuracy({s: a for s, _t, a in r["accs"]}) for k, r in runs.items()}
        case["acc_final_step"] = {"single_process": single[max(single)],
                                  **{k: r["final_acc"] for k, r in runs.items()}}
        gap = case["acc_same_samples"]["accumulate"] - case["single_process_acc"]
        case["accumulate_acc_gap_points"] = 100 * abs(gap)
        out[model] = case
    # beside: the MLP with DDP's bucket plan kept (`--buckets ddp`), the tuned plan's baseline
    print("  real mlp: even, with DDP's bucket plan (--buckets ddp)", flush=True)
    fixed = launch("real-mlp-even-ddp-buckets", pinned, ["--model", "mlp", "--kinds", "ddp+even", *common],
                   flags=("--buckets", "ddp"))
    out["mlp_ddp_buckets"] = even_case(fixed, gb, skip)
    out["host"] = {"cpus": os.cpu_count(), "loadavg_1min_before": load0[0], "loadavg_1min_after": os.getloadavg()[0]}
    if quick:  # the shared-cores case runs in the full benchmark only (time)
        return out
    shared = {"name": "shared", "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": 1.0}}
                                             for i in range(3)]}
    print("  real mlp, 3 workers sharing the host's cores", flush=True)
    res = launch("real-shared", shared, ["--model", "mlp", "--kinds", "speed,ddp+balanced+accumulate,speed",
                                         "--slow", f"0,0,{SLOW}", *common])
    sh = summarize({"runs": [dict(r, kind="even" if r["kind"] == "balanced" else r["kind"]) for r in res["runs"]
                             if r["kind"] in ("ddp", "balanced")]}, res, gb, skip)
    sh.pop("even_over_ddp"), sh.pop("even")
    out["shared_cores_mlp"] = sh
    out["host"] = {"cpus": os.cpu_count(), "loadavg_1min_before": load0[0], "loadavg_1min_after": os.getloadavg()[0]}
    return out


def table(r: dict) -> list[str]:
    h = r["host"]
    lines = [f"== real compute, overlap on for both (2 workers, a core each; worker 1 runs {r['slow_extra_forwards']} "
             f"extra forwards when uneven; global batch {r['global_batch']}; {r['repeats']} interleaved repeats x "
             f"{r['steps']} steps, medians after step {r['skip']}; host {h['cpus']} CPUs, 1-min load "
             f"{h['loadavg_1min_before']:.1f} -> {h['loadavg_1min_after']:.1f}) ==",
             f"{'model':<12}{'even/DDP':>9}{'ideal':>7}{'unequal/DDP':>12}{'of ideal':>9}{'accum/DDP':>10}"
             f"{'of ideal':>9}{'acc 1-proc':>11}{'acc accum':>10}{'tta ddp':>8}{'tta uneq':>9}{'tta acc':>8}"]
    f = lambda v: f"{v:.1f}s" if v is not None else "-"  # noqa: E731
    for m in MODELS:
        if m not in r:
            continue
        c, u = r[m], r[m]["uneven"]
        t = c["time_to_acc_s"]
        lines.append(f"{m:<12}{c['even_over_ddp']:>9.3f}{u['ideal_over_ddp']:>7.3f}{u['balanced']['over_ddp']:>12.3f}"
                     f"{u['balanced']['over_ideal']:>9.3f}{u['accumulate']['over_ddp']:>10.3f}"
                     f"{u['accumulate']['over_ideal']:>9.3f}{c['single_process_acc']:>11.4f}"
                     f"{c['acc_same_samples']['accumulate']:>10.4f}{f(t['ddp']):>8}{f(t['balanced']):>9}"
                     f"{f(t['accumulate']):>8}")
    for m in MODELS:
        u = r.get(m, {}).get("uneven", {})
        if "ddp-static" in u:
            lines.append(f"{m}, DDP given the best static shares for the measured speeds (an oracle): "
                         f"{u['ddp-static']['over_ddp']:.3f}x DDP ({u['ddp-static']['over_ideal']:.2f} of ideal); "
                         f"hetrain unequal / static DDP {u['balanced']['over_ddp'] / u['ddp-static']['over_ddp']:.3f}")
        if "tail" in u:
            lines.append(f"{m} with a dynamic tail ({TAIL:.0%} of each step claimed while it runs, about {TAIL_CHUNKS} "
                         f"chunks per worker): {u['tail']['over_ddp']:.3f}x DDP ({u['tail']['over_ideal']:.2f} of "
                         f"ideal); end-of-backward skew {u['balanced']['arrival_skew_ms']:.1f} ms without, "
                         f"{u['tail']['arrival_skew_ms']:.1f} ms with")
    for m in MODELS:
        b = r.get(m, {}).get("uneven", {}).get("balanced")
        if b and "later_worker_wait_ms" in b:
            lines.append(f"{m} unequal: step {b['behind_ideal_step_ms']:.1f} ms behind the ideal step, of which "
                         f"{b['later_worker_wait_ms']:.1f} ms waiting for the later worker's forward+backward "
                         f"(step-to-step noise, {100 * b.get('step_noise', float('nan')):.0f}% sd; medians over repeats)")
        nb = r.get(m, {}).get("uneven", {}).get("noise_bound")
        if nb:
            lines.append(f"{m}: the best fixed split, replayed on hetrain's unequal steps with each worker's measured "
                         f"step-to-step noise, loses {nb['penalty_ms']:.1f} ms a step to it: {nb['over_ddp']:.3f}x DDP "
                         f"({nb['over_ideal']:.2f} of ideal) is the most any fixed split reaches (hetero_noise.py)")
    for m in MODELS:
        u = r.get(m, {}).get("uneven", {})
        apart = [f"{u[k]['speed_apart_max']:.0%}" for k in STRATEGIES if "speed_apart_max" in u.get(k, {})]
        if apart:
            lines.append(f"{m}: each worker's speed measured before and after a repeat's runs, apart by up to "
                         f"{' / '.join(apart)} (unequal / accumulate / tail launches; the ideal takes each worker's "
                         f"faster; over {SPEED_DISAGREE:.0%}: a host slowdown in one measurement)")
    if "mlp_ddp_buckets" in r:
        lines.append(f"mlp even with DDP's bucket plan kept (--buckets ddp): {r['mlp_ddp_buckets']['even_over_ddp']:.3f}x "
                     "DDP (the row above: buckets tuned)")
    if "shared_cores_mlp" in r:
        u = r["shared_cores_mlp"]["uneven"]
        lines.append(f"shared cores (3 workers, MLP, worker 2 slow): ideal {u['ideal_over_ddp']:.3f}x DDP, unequal "
                     f"{u['balanced']['over_ddp']:.3f}x ({u['balanced']['over_ideal']:.2f} of ideal), accumulate "
                     f"{u['accumulate']['over_ddp']:.3f}x ({u['accumulate']['over_ideal']:.2f} of ideal)")
    lines.append("bars: even/DDP >= 1.00 (goal 1.05); of ideal >= 0.85 (goal 0.95); accumulate's accuracy within "
                 f"0.5 point of one process (acc: mean test accuracy over the last {LAST_EVALS} evaluations, every "
                 f"{EVAL_EVERY} steps); tta: time to test accuracy {r['target_acc']} (evaluation excluded)")
    return lines


def plot(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if m in r]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(len(models))
    a1.bar(x, [r[m]["even_over_ddp"] for m in models], color="tab:blue")
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_xticks(x, models)
    a1.set_title("even work: hetrain / DDP samples/s")
    bars = [("ideal", "ideal_over_ddp", "lightgray"), ("unequal batches", "balanced", None),
            ("accumulate", "accumulate", None), ("unequal + tail", "tail", None),
            ("DDP, best static shares", "ddp-static", "dimgray")]
    bars = [b for b in bars if all(b[1] in r[m]["uneven"] for m in models)]
    w = 0.8 / len(bars)
    for i, (label, key, color) in enumerate(bars):
        vals = [r[m]["uneven"][key] if key == "ideal_over_ddp" else r[m]["uneven"][key]["over_ddp"] for m in models]
        a2.bar(x + (i - (len(bars) - 1) / 2) * w, vals, w, label=label, color=color)
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_xticks(x, models)
    a2.set_title("uneven work: speed-up over DDP")
    a2.set_ylim(0, 1.35 * max(r[m]["uneven"]["ideal_over_ddp"] for m in models))  # room for the legend
    a2.legend(fontsize=8, loc="upper center", ncol=2)
    h = r["host"]
    fig.suptitle(f"real compute, overlap on; 1-min load {h['loadavg_1min_before']:.1f}-{h['loadavg_1min_after']:.1f} "
                 f"on {h['cpus']} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
