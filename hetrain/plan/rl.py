"""HeterPS's scheduler: an LSTM policy picks a resource type per layer, trained with
REINFORCE against the shared cost model.

* Input: the layers in order, each as a feature vector (log host time, log times and
  log one-layer-stage prices on every type, bytes, kind, position), normalised per problem.
* Policy: Linear -> LSTM (reads the layers first to last) -> Linear -> logits over types.
  A plan is one categorical draw per layer given the LSTM state; a batch of plans is
  sampled per update from one LSTM pass, so a 200-layer model trains in seconds.
* Reward: -log(cost/ref) (ref = the cheapest price in the first batch; the log keeps the
  scale of rewards the same for every model and catalogue), with the cost scaled up by
  (1 + mu x relative over-use) when a plan needs more instances of a type than are
  available (a soft penalty the policy can climb out of), clipped at -clip; a plan with
  a stage that no count can make meet the target gets -(clip + such stages). Instance
  counts are the smallest meeting the target (the cost model's stage tables).
* Update: REINFORCE with a moving-average baseline, advantages scaled by a running
  std, an entropy bonus that decays, Adam. The best plan ever sampled is kept, and the
  policy's greedy (arg-max) plan is scored at the end too.
* Polish (switchable, `polish=True`): every 50 updates and at the end of each restart a
  steepest-descent local search (`baselines.local_search`) on the best sampled plan.
  Then, once, on the best plan of all restarts: an iterated local search
  (`baselines.iterated_local_search`, `kicks=100`): steepest descent over retype-a-layer,
  move-a-stage-boundary-by-1,2,3,4,6,8,...-layers, repaint-runs-of-stages and
  random-segment moves, with a two-move lookahead when it stalls, then 100 times: perturb
  the best plan by 1-3 random moves and descend again. After each descent (and each
  periodic polish) `baselines.realign` keeps the plan's sequence of stage types and
  places all its boundaries at once (a dynamic programme over boundaries: on 200 layers
  the cheapest placement of a sequence can need many boundaries moved together, which
  one- and two-move steps do not find). Every candidate is scored with
  the shared cost model; nothing here calls `exact`. `info.policy_hourly` is the best
  plan before the final polishes (it includes the periodic polish).
* Seeded (torch.manual_seed + numpy Generator) and single-threaded.
"""
from __future__ import annotations

import sys

import numpy as np

from ..perf.pipeline import score_assignments
from .base import Planner, Problem
from .baselines import iterated_local_search, local_search, realign


class _Adam:
    """Plain Adam (Kingma & Ba) on a few tensors. torch.optim's first use imports
    torch._dynamo, which costs seconds on a small machine; this keeps planning fast."""

    def __init__(self, params, lr: float, torch, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.b1, self.b2, self.eps, self.t = list(params), lr, *betas, eps, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.torch = torch

    def step(self) -> None:
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        with self.torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v):
                if p.grad is None:
                    continue
                m.mul_(self.b1).add_(p.grad, alpha=1 - self.b1)
                v.mul_(self.b2).addcmul_(p.grad, p.grad, value=1 - self.b2)
                p.addcdiv_(m / c1, (v / c2).sqrt_().add_(self.eps), value=-self.lr)


def layer_features(problem: Problem) -> np.ndarray:
    w, H = problem.workload, problem.tables.hourly
    L = w.n_layers
    idx = np.arange(L)
    single = H[idx, idx + 1, :]                                    # (L, R) $/h as a lone stage
    fin = np.isfinite(single)
    cap = np.nanmax(np.where(fin, single, np.nan)) if fin.any() else 1.0
    logp = np.log(np.where(fin, single, cap * 10) + 1e-12)
    logp = logp - logp.min(axis=1, keepdims=True)                   # relative to the cheapest type
    logt = np.log(w.compute)
    logt = (logt - logt.mean()) / (logt.std() + 1e-9)
    def z(x):
        lx = np.log1p(x)
        return (lx - lx.mean()) / (lx.std() + 1e-9)
    feats = [logp, logt, (~fin).astype(float),
             np.stack([z(w.act_bytes), z(w.dense_param_bytes), z(w.sparse_param_bytes),
                       (w.sparse_param_bytes > 0).astype(float), idx / max(1, L - 1)], axis=1)]
    return np.concatenate(feats, axis=1).astype(np.float32)


def _sample_plans(rng: np.random.Generator, base: np.ndarray, stay: np.ndarray, batch: int) -> np.ndarray:
    """`batch` plans from the policy, layer by layer: a_l ~ softmax(base_l + stay_l *
    onehot(a_{l-1})), by the Gumbel-max trick."""
    L, R = base.shape
    rows = np.arange(batch)
    g = rng.gumbel(size=(batch, L, R))
    A = np.empty((batch, L), dtype=np.int64)
    A[:, 0] = np.argmax(base[0] + g[:, 0], axis=1)
    for l in range(1, L):
        z = base[l] + g[:, l]
        z[rows, A[:, l - 1]] += stay[l]
        A[:, l] = np.argmax(z, axis=1)
    return A


def _log_probs(torch, base, stay, A: np.ndarray):
    """Log-probability of each sampled plan under the policy (for REINFORCE) and the mean
    per-layer entropy (for the entropy bonus)."""
    batch, (L, R) = A.shape[0], base.shape
    At = torch.from_numpy(A)
    z = base.unsqueeze(0).expand(batch, L, R).clone()
    prev = torch.nn.functional.one_hot(At[:, :-1], R).float()
    z[:, 1:] = z[:, 1:] + stay[1:, None] * prev
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(2, At[:, :, None])[:, :, 0].sum(dim=1)
    ent = -(logp.exp() * logp).sum(dim=-1).mean()
    return lp, ent


def _greedy_plan(b: np.ndarray, st: np.ndarray) -> np.ndarray:
    """The policy's most likely plan, decoded layer by layer."""
    L = b.shape[0]
    greedy = np.empty(L, dtype=np.int64)
    greedy[0] = np.argmax(b[0])
    for l in range(1, L):
        z = b[l].copy(); z[greedy[l - 1]] += st[l]
        greedy[l] = np.argmax(z)
    return greedy


class RLPlanner(Planner):
    """LSTM policy + REINFORCE (HeterPS). Not a wrapper of `exact`: it only ever sees
    rewards of sampled plans."""

    name = "rl"

    def __init__(self, updates: int = 500, batch: int = 128, hidden: int = 64, lr: float = 0.01,
                 entropy: float = 0.05, seed: int = 0, patience: int = 200, progress: bool | None = None,
                 threads: int = 1, restarts: int = 2, polish: bool = True, polish_every: int = 50,
                 replay: bool = True, kicks: int = 100, mu: float = 2.0, stay_prior: float | tuple = (0.0, 3.0), clip: float = 5.0):
        self.updates, self.batch, self.hidden, self.lr = updates, batch, hidden, lr
        self.entropy, self.seed, self.patience, self.threads = entropy, seed, patience, threads
        self.progress = progress
        self.restarts = max(1, int(restarts))
        self.polish, self.polish_every, self.replay = polish, max(1, polish_every), replay
        self.kicks = max(0, int(kicks))
        # the "stay" prior cycles over restarts: 0 explores freely, 3 starts from long stages
        self.stay_priors = tuple(stay_prior) if isinstance(stay_prior, (tuple, list)) else (float(stay_prior),)
        self.mu, self.clip = mu, clip

    def solve(self, problem: Problem):
        import torch
        from torch import nn

        old_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            best_a, best_h = None, np.inf
            info = {"updates": 0, "samples": 0, "restarts": self.restarts, "policy_hourly": np.inf}
            for i in range(self.restarts):
                a, h, inf_i = self._train(problem, torch, nn, self.seed + 7919 * i,
                                          self.stay_priors[i % len(self.stay_priors)])
                info["updates"] += inf_i["updates"]
                info["samples"] += inf_i["samples"]
                info["policy_hourly"] = min(info["policy_hourly"], inf_i["policy_hourly"])
                if a is not None and h < best_h:
                    best_a, best_h = a, h
                    info["entropy"] = inf_i["entropy"]
                    info["best_restart"] = i
        finally:
            torch.set_num_threads(old_threads)
        if best_a is None:
            info["reason"] = "no sampled plan met the target"
            return None, info
        info["before_ils_hourly"] = best_h
        if self.polish and self.kicks:
            # final iterated local search on the best plan of all restarts (cost-model moves only)
            rng = np.random.default_rng(self.seed + 104729)
            a, h = iterated_local_search(problem.tables, problem.workload, np.asarray(best_a), rng,
                                         kicks=self.kicks)
            if np.isfinite(h) and h < best_h:
                best_a, best_h = a, h
        return tuple(int(v) for v in best_a), info

    def _train(self, problem: Problem, torch, nn, seed: int, stay_prior: float):
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        w, tables = problem.workload, problem.tables
        L, R = w.n_layers, w.n_types
        x = torch.from_numpy(layer_features(problem))[None]           # (1, L, F)
        F = x.shape[-1]
        enc = nn.Linear(F, self.hidden)
        lstm = nn.LSTM(self.hidden, self.hidden, batch_first=True)
        head = nn.Linear(self.hidden, R + 1)       # R type logits + a "stay on the previous type" bonus
        with torch.no_grad():                      # prior: neighbouring layers tend to share a type
            head.bias[R] = stay_prior
        params = [*enc.parameters(), *lstm.parameters(), *head.parameters()]
        opt = _Adam(params, self.lr, torch)

        def policy():
            h, _ = lstm(torch.tanh(enc(x)))
            out = head(h)[0]                                          # (L, R+1)
            return out[:, :R], out[:, R]

        best_a, best_h = None, np.inf
        soft_a, soft_v = None, np.inf
        baseline, spread = None, 1.0
        ref = None
        since_best = 0
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        bar = None
        if show:
            from tqdm import tqdm
            bar = tqdm(total=self.updates, desc=f"rl seed {seed}", leave=False)
        n_done, ent_v = 0, float("nan")
        for u in range(self.updates):
            base, stay = policy()
            A = _sample_plans(rng, base.detach().numpy().astype(np.float64),
                              stay.detach().numpy().astype(np.float64), self.batch)
            if self.polish and u % self.polish_every == 0 and u:
                start = best_a if best_a is not None else soft_a
                if start is not None:
                    best_a, best_h = self._polish(tables, w, start, best_h, rng, best_a)
            elite = best_a if best_a is not None else soft_a
            if self.replay and elite is not None:
                A[0] = elite           # elite replay: the best plan so far keeps pulling the policy
            hourly, viol, raw, nbad = score_assignments(tables, w, A, raw=True)
            ok = np.isfinite(hourly) & (viol == 0)
            if ok.any():
                i = int(np.argmin(np.where(ok, hourly, np.inf)))
                if hourly[i] < best_h * (1 - 1e-12):
                    best_h, best_a, since_best = float(hourly[i]), A[i].copy(), 0
            if ref is None and np.isfinite(raw).any():
                ref = float(np.min(raw))     # price scale: cheapest plan of the first batch (counts ignored)
            since_best += 1
            scale = ref if ref is not None else 1.0
            # -price/ref; over-use of a type's count scales the price up (a soft penalty the
            # policy can climb out of); a stage impossible at any count is worse than all
            over = viol - nbad
            soft = raw / scale * (1.0 + self.mu * over)
            if best_a is None and np.isfinite(soft).any():   # nearest-to-feasible plan so far
                i = int(np.argmin(np.where(nbad > 0, np.inf, soft)))
                if np.isfinite(soft[i]) and nbad[i] == 0 and soft[i] < soft_v:
                    soft_a, soft_v = A[i].copy(), float(soft[i])
            reward = np.where(nbad > 0, -(self.clip + np.minimum(nbad, 10.0)),
                              -np.minimum(np.log(np.maximum(soft, 1e-12)), self.clip))
            mean = float(reward.mean())
            baseline = mean if baseline is None else 0.9 * baseline + 0.1 * mean
            spread = 0.9 * spread + 0.1 * float(reward.std() + 1e-6)
            adv = torch.from_numpy(((reward - baseline) / max(spread, 1e-3)).astype(np.float32))
            lp, ent = _log_probs(torch, base, stay, A)
            beta = self.entropy * max(0.0, 1.0 - u / (0.7 * self.updates))
            loss = -(adv * lp).mean() / L ** 0.5 - beta * ent
            for q in params:
                q.grad = None
            loss.backward()
            opt.step()
            n_done, ent_v = u + 1, float(ent.detach())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(best=f"{best_h:.3g}", H=f"{ent_v:.2f}")
            if since_best > self.patience and ent_v < 0.01:
                break
        if bar is not None:
            bar.close()
        with torch.no_grad():
            base, stay = policy()
            greedy = _greedy_plan(base.numpy(), stay.numpy())
        gh, gv = score_assignments(tables, w, greedy[None])
        if np.isfinite(gh[0]) and gv[0] == 0 and gh[0] < best_h:
            best_h, best_a = float(gh[0]), greedy
        policy_h = best_h
        start = best_a if best_a is not None else soft_a
        if self.polish and start is not None:
            best_a, best_h = self._polish(tables, w, start, best_h, rng, best_a)
        return best_a, best_h, {"updates": n_done, "samples": n_done * self.batch, "entropy": ent_v,
                                "policy_hourly": policy_h}

    @staticmethod
    def _polish(tables, w, start, h, rng, current):
        """Local search from `start`; returns the better of it and (current, h)."""
        b, bh = realign(tables, w, local_search(tables, w, start, rng))
        if np.isfinite(bh) and bh < h:
            return b, float(bh)
        return current, h
