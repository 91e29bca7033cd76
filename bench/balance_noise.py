"""What step-to-step noise costs a balanced step, and how much of it hetrain's balancer adds.

A synchronous step ends when its later worker does. Shares fixed before the step can only
match the workers' mean speeds, so where each worker's compute varies from step to step
the step pays the expected maximum of their noise: the ideal of bench/hetero.py (every
worker finishing together by its fitted speed) does not count that, and no fixed split
removes it. The balancer pays it too, and one thing more: it estimates the speeds from
the same noisy steps, so its split wanders with them (or, held against noise, stays a
little off).

This bench drives the real `hetrain.train.balance.Balancer` (step-time fits, hold, solve,
exchange one step late) of two workers in one process, in lockstep, on synthetic compute
times: worker i takes (fixed_i + per_i x samples) x exp(e_i), e_i an AR(1) noise with
standard deviation `sigma` and lag-1 correlation `rho` (bench/hetero.py's real cases
report their own as `step_noise`; on this project's 2-core host the transformer's steps
are the noisiest, with heavy tails and lag-1 correlations up to 0.6), independent between
workers, the same draws for every system. The fits are the transformer's of bench/hetero.py's real cases (fixed 1.0 and
0.7 ms, 0.109 and 0.216 ms a sample, 512 samples a step). Per noise level:

  noise cost   the hindsight-best fixed split's mean step over the noiseless ideal step
               (what any fixed split pays; its share of the gain is what bench/hetero.py's
               `noise_bound` reports for a real run)
  balancer     hetrain's mean step over the hindsight-best fixed split's, for the default
               configuration (hold 1%, hold_noise 2) and two variants: hold_noise 0 (hold
               1% only) and hold 0 (re-split at every exchange)

Means over seeds; steps after the first `SKIP` (the balancer's first measurements).

    python bench/balance_noise.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetrain.perf.steptime import solve_shares, step_floor  # noqa: E402
from hetrain.train.balance import Balancer, BalanceConfig  # noqa: E402
from hetrain.train.exchange import InProcessExchange  # noqa: E402

FIXED = np.array([1.0e-3, 0.7e-3])  # seconds a pass: the transformer's fits, bench/hetero.py's real cases
PER = np.array([0.109e-3, 0.216e-3])  # seconds a sample
BATCH = 512
SKIP = 40
VARIANTS = {"default": {}, "hold_noise 0": {"hold_noise": 0.0}, "hold 0": {"hold": 0.0}}


def noise_draws(sigma: float, rho: float, steps: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """steps x n multiplicative noise exp(e), e an AR(1) with sd `sigma` and lag-1 `rho`."""
    e = np.zeros((steps, n))
    e[0] = rng.normal(0.0, sigma, n)
    for t in range(1, steps):
        e[t] = rho * e[t - 1] + np.sqrt(1 - rho * rho) * rng.normal(0.0, sigma, n)
    return np.exp(e)


def balancer_steps(cfg: BalanceConfig, noise: np.ndarray, slow_at: int | None = None,
                   factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Each step's time (its later worker's compute) and worker 0's share, with two real
    Balancers in lockstep; from step `slow_at` on, worker 0 computes `factor` x slower."""
    ex = InProcessExchange(2)
    bal = [Balancer(None, BATCH, cfg, gather=ex.gather_for(r), num_workers=2) for r in range(2)]
    out, share = np.empty(len(noise)), np.empty(len(noise), dtype=np.int64)
    for t, z in enumerate(noise):
        sizes = bal[0].sizes.copy()
        per = PER * np.array([factor if slow_at is not None and t >= slow_at else 1.0, 1.0])
        times = (FIXED + per * sizes) * z * (sizes > 0)
        out[t], share[t] = times.max(), sizes[0]
        for r, b in enumerate(bal):
            b.record(int(sizes[r]), float(times[r]))
        for b in bal:
            b.update()
        if not np.array_equal(bal[0].sizes, bal[1].sizes):
            raise RuntimeError(f"simulated workers disagree on the shares: {bal[0].sizes} vs {bal[1].sizes}")
    return out, share


def best_share(per0: float) -> int:
    """Worker 0's share of the exact min-max split without noise (perf.steptime)."""
    return int(solve_shares(BATCH, FIXED, [per0, PER[1]], [BATCH, BATCH])[0])


def follow(factors, sigma: float, seeds: int, at: int = 60, steps: int = 160) -> list[dict]:
    """Worker 0 turning `factor` x slower (or faster) at step `at`: the steps until its
    share is within 5% of the new best and stays there for 5 steps (median over seeds),
    and its share at the end against the best."""
    rows = []
    for factor in factors:
        target = best_share(PER[0] * factor)
        after, final = [], []
        for seed in range(seeds):
            noise = noise_draws(sigma, 0.0, steps, 2, np.random.default_rng(100 + seed))
            _, share = balancer_steps(BalanceConfig(), noise, at, factor)
            near = np.abs(share - target) <= 0.05 * target
            hit = [i for i in range(at, steps - 5) if near[i:i + 5].all()]
            after.append(hit[0] - at if hit else None)
            final.append(int(share[-1]))
        took = [a for a in after if a is not None]
        rows.append({"factor": factor, "sigma": sigma, "best_share": target, "share_before": best_share(PER[0]),
                     "steps_to_follow": float(np.median(took)) if took else None,
                     "followed": f"{len(took)}/{seeds}", "final_share": int(np.median(final))})
    return rows


def best_fixed(noise: np.ndarray) -> tuple[float, int]:
    """The least mean step over every fixed split (worker 0's samples), with the noise."""
    s0 = np.arange(1, BATCH)[:, None]
    t0 = (FIXED[0] + PER[0] * s0) * noise[None, :, 0]
    t1 = (FIXED[1] + PER[1] * (BATCH - s0)) * noise[None, :, 1]
    means = np.maximum(t0, t1).mean(axis=1)
    k = int(np.argmin(means))
    return float(means[k]), int(s0[k, 0])


def ideal_step() -> float:
    """Both workers finishing together on the noiseless fits: the floor no split beats."""
    return step_floor(BATCH, FIXED, PER)


def run(sigmas, rhos, seeds: int, steps: int) -> list[dict]:
    from tqdm import tqdm

    rows = []
    cases = [(s, r) for r in rhos for s in sigmas]
    for sigma, rho in tqdm(cases, desc="noise levels", file=sys.stderr):
        cost, over, split = [], {k: [] for k in VARIANTS}, []
        for seed in range(seeds):
            noise = noise_draws(sigma, rho, steps, 2, np.random.default_rng(seed))
            best, s0 = best_fixed(noise[SKIP:])
            cost.append(best / ideal_step() - 1)
            split.append(s0)
            for name, change in VARIANTS.items():
                steps_s, _ = balancer_steps(replace(BalanceConfig(), **change), noise)
                over[name].append(float(steps_s[SKIP:].mean()) / best - 1)
        rows.append({"sigma": sigma, "rho": rho, "seeds": seeds, "steps": steps,
                     "best_fixed_split": int(np.median(split)),
                     "noise_cost": float(np.mean(cost)),
                     "balancer_over_best_fixed": {k: float(np.mean(v)) for k, v in over.items()},
                     "balancer_over_best_fixed_max": {k: float(np.max(v)) for k, v in over.items()}})
    return rows


def table(rows: list[dict]) -> list[str]:
    names = list(VARIANTS)
    head = f"{'sigma':>6}{'rho':>5}{'best split':>11}{'noise cost':>11}" + "".join(f"{n:>15}" for n in names)
    lines = [f"== two workers, {BATCH} samples, the transformer's fits; mean step over the hindsight-best fixed "
             "split's, less 1 (balancer columns), and the best fixed split's over the noiseless ideal (noise cost) ==",
             head]
    for r in rows:
        b = r["balancer_over_best_fixed"]
        lines.append(f"{r['sigma']:>6.2f}{r['rho']:>5.1f}{r['best_fixed_split']:>11}{100 * r['noise_cost']:>10.1f}%"
                     + "".join(f"{100 * b[n]:>14.2f}%" for n in names))
    lines.append("noise cost: what every fixed split pays over the ideal; balancer columns: what hetrain's own "
                 "estimates add to it (default: hold 1%, hold_noise 2)")
    return lines


def follow_table(rows: list[dict]) -> list[str]:
    lines = [f"== worker 0 turns k x slower at step 60 (noise sigma {rows[0]['sigma']}): its share, and the steps "
             "until it is within 5% of the new best for 5 steps (median over seeds) ==",
             f"{'k':>6}{'share before':>13}{'new best':>9}{'followed':>9}{'steps':>7}{'share at end':>13}"]
    for r in rows:
        steps = "-" if r["steps_to_follow"] is None else f"{r['steps_to_follow']:.0f}"
        lines.append(f"{r['factor']:>6.2f}{r['share_before']:>13}{r['best_share']:>9}{r['followed']:>9}{steps:>7}"
                     f"{r['final_share']:>13}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer seeds and steps")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    seeds, steps = (4, 200) if a.quick else (10, 400)
    rows = run((0.02, 0.05, 0.10, 0.15), (0.0, 0.5), seeds, steps)
    changes = follow((0.25, 0.5, 1.3, 2.0, 4.0), 0.05, seeds)
    print("\n".join(table(rows)))
    print("\n".join(follow_table(changes)))
    if a.json:
        a.json.write_text(json.dumps({"fixed_s": FIXED.tolist(), "per_sample_s": PER.tolist(), "batch": BATCH,
                                      "skip": SKIP, "rows": rows,
                                      "change_of_speed": changes}, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
