"""`hetrain train --plan plan.json`: run a placement plan, on emulated or real devices.

Compiles the plan into a run spec (stages, replicas, sparse-PS shards, the cost
model's per-stage times, each stage's device from `--devices`: pipeline/devicemap.py),
writes a cluster file with one worker machine per process, starts them with the single
launcher (mode allreduce, module ``hetrain.pipeline.worker``), and reports measured
throughput beside the cost model's prediction.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..modes import Mode


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="run a placement plan (HeterPS runtime) and compare throughput with the cost model",
        description="Run a plan written by `hetrain plan` as a pipeline of stage processes with a sharded "
                    "sparse parameter server on the emulated cluster; print measured vs predicted samples/s.")
    p.add_argument("--plan", required=True, help="plan JSON written by `hetrain plan --out`")
    p.add_argument("--catalogue", default=None,
                   help="catalogue the plan was made with, or a cluster file whose `kinds:` describe its machines; "
                        "a plan it cannot hold is refused before anything starts (default: "
                        "hetrain/data/catalogue_heterps_emu.yaml, the emulated HeterPS cluster)")
    p.add_argument("--profile", default=None,
                   help="layer profile JSON the plan was made from (default: the built-in ctr-small profile)")
    p.add_argument("--steps", type=int, default=6, help="training steps of the plan's batch size (6)")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the throughput (1)")
    p.add_argument("--micro-batches", type=int, default=32, help="micro-batches per step (32)")
    p.add_argument("--ps-shards", type=int, default=2,
                   help="sparse parameter-server shards (2; raised when the tables exceed a shard's memory)")
    p.add_argument("--ps-memory", default=None,
                   help="memory cap of one shard, e.g. 64MiB (default: the embedding stage type's memory)")
    p.add_argument("--optimizer", default="adagrad", choices=["adagrad", "sgd"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--no-emulate", action="store_true",
                   help="do not pad micro-batches to the cost model's time (correctness runs)")
    p.add_argument("--devices", default="emulated", metavar="emulated|real|FILE",
                   help="what runs each plan type: emulated devices (default; padded to the cost model's times), "
                        "real = the plan's GPU types on this host's CUDA GPU and its CPU types as CPU processes "
                        "(no padding), or a YAML file mapping each type to cuda or cpu (with threads: N); see "
                        "docs/heterps-runtime.md"),
    p.add_argument("--ckpt-dir", default=None, help="checkpoint folder (default: RUN_DIR/ckpt)")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="resume from the newest complete checkpoint")
    p.add_argument("--run-dir", default=None, help="logs, spec, metrics (default runs/train-<time>)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds before a lost peer is reported (30)")
    p.add_argument("--json", default=None, help="write the result (measured, predicted, cost) here")
    p.add_argument("--quiet", action="store_true", help="do not echo every process's output")
    p.add_argument("--fail-at", default=None, help=argparse.SUPPRESS)  # RANK:STEP, fault injection for tests
    p.set_defaults(func=run)


def compile_plan(plan: dict, catalogue_path: str | None = None, profile_path: str | None = None,
                 devices: str = "emulated", **opts):
    """Plan JSON -> (RunSpec, PlanScore from the cost model, catalogue). `devices`: see
    `--devices` (pipeline/devicemap.py)."""
    from ..cluster.units import parse_size
    from ..perf.comm import ring_allreduce_time
    from ..perf.pipeline import CostParams, evaluate, stage_memory
    from .devicemap import load_device_map
    from ..plan.catalogue import check_plan, load_catalogue
    from ..plan.profile import ModelProfile
    from .sparse_ps import shards_needed
    from ..plan.render import parse_plan
    from .spec import RunSpec, StageSpec, lcm_micro_batches
    from .workload import CATALOGUE, MODEL_NAME, CTRModelConfig, emulated_profile

    doc = parse_plan(plan, "file")
    plan = doc.model_dump()
    catalogue = load_catalogue(catalogue_path or CATALOGUE)
    check_plan(plan, catalogue, catalogue_path or CATALOGUE)
    profile = ModelProfile.load(profile_path) if profile_path else emulated_profile()
    if profile.model != MODEL_NAME:
        raise UserError(f"the runtime trains the {MODEL_NAME!r} model; the profile is for {profile.model!r}")
    names = [l.name for l in profile.layers]
    w = profile.workload(catalogue)
    assign = []
    for st in doc.stages:
        a, b = st.layers
        if st.layer_names and st.layer_names != names[a:b]:
            raise UserError(f"plan stage layers {st.layer_names} do not match the model's layers {names[a:b]}: "
                            "make the plan from this model's profile (python -m hetrain.pipeline.workload)")
        assign += [catalogue.index(st.type)] * (b - a)
    if len(assign) != len(names) or [st.layers[0] for st in doc.stages] != [0] + [st.layers[1] for st in doc.stages[:-1]]:
        raise UserError(f"the plan places {len(assign)} layers, the model has {len(names)}: stages.N.layers must "
                        f"cover 0..{len(names)} in order, without gaps or overlaps")
    batch = doc.batch_size
    params = CostParams(batch_size=batch)
    inst = [st.instances for st in doc.stages]
    if any(a.type == b.type for a, b in zip(doc.stages, doc.stages[1:])):
        raise UserError("two neighbouring plan stages have the same type; the cost model counts them as one "
                        "stage: merge them (sum their instances) or give them different types")
    score = evaluate(w, assign, doc.target, params, instances=inst)
    devmap = load_device_map(devices, catalogue)
    stages = []
    for st, sc in zip(doc.stages, score.stages):
        pd = float(w.dense_param_bytes[sc.start:sc.end].sum())
        stored = float(w.stored_act_bytes[sc.start:sc.end].sum())
        stages.append(StageSpec(sc.start, sc.end, st.type, st.kind, sc.instances,
                                float(sc.time_per_sample), ring_allreduce_time(pd, sc.instances, float(w.bandwidth[sc.rtype])),
                                device=devmap.device_of(st.type), threads=devmap.threads_of(st.type) or 0,
                                # what a replica keeps: the sparse tables live on the shards
                                memory_bytes=stage_memory(pd, 0.0, stored, sc.instances, params)))
    opts["emulate"] = opts.get("emulate", True) and devmap.emulated  # real devices are never padded
    cfg = CTRModelConfig()
    sparse_types = [catalogue.kinds[sc.rtype] for sc in score.stages if w.sparse_param_bytes[sc.start:sc.end].sum() > 0]
    try:
        cap = parse_size(opts.pop("ps_memory")) if opts.get("ps_memory") else min(t.memory for t in sparse_types)
    except ValueError as err:
        raise UserError(f"--ps-memory: {err}") from None
    opts.pop("ps_memory", None)
    shards = shards_needed(cfg.n_tables * cfg.rows, cfg.dim, cap, opts.pop("ps_shards", 2))
    mbs = lcm_micro_batches(opts.pop("micro_batches", 32), inst, batch)
    spec = RunSpec(stages=stages, batch=batch, micro_batches=mbs, ps_shards=shards, model=cfg, **opts)
    return spec, score, catalogue


def cluster_for(spec, catalogue) -> dict:
    """One worker machine per process: stage replicas on their plan type (a real CUDA
    device where the stage's device is `cuda`, pinned cores where it has `threads`),
    shards as CPU processes co-located with the embedding stage (the cost model shards
    the tables over that stage's instances, so they add no price). The kinds the stages
    use are described as the catalogue describes them."""
    machines = []
    for s, st in enumerate(spec.stages):
        t = catalogue.kind(st.type)
        for r in range(st.instances):
            m = {"name": f"s{s}r{r}", "role": "worker",
                 "device": {"kind": st.type, "speed": 1.0, "memory": t.memory, "cuda": st.device == "cuda"},
                 "bandwidth": t.bandwidth}
            if st.threads:
                m["threads"] = st.threads
            machines.append(m)
    for j in range(spec.ps_shards):
        machines.append({"name": f"ps{j}", "role": "worker", "device": {"kind": "cpu-ps", "speed": 1.0}})
    kinds = [catalogue.kind(n).to_file() for n in dict.fromkeys(st.type for st in spec.stages)]
    kinds.append({"name": "cpu-ps", "class": "cpu", "note": "a sparse parameter-server shard"})
    return {"name": "heterps", "kinds": kinds, "machines": machines, "network": {"emulate": "none"}}


def measured_throughput(spec, metrics: list[dict]) -> float:
    """Samples/s between the end of the warm-up steps and the last step (stage 0, replica 0)."""
    m = next(x for x in metrics if x.get("role") == "stage0/replica0")
    ends = m["step_end_time"]
    w = spec.warmup_steps - m.get("start_step", 0)
    w = max(w, 1) if len(ends) > 1 else 0
    if len(ends) - w < 1 or w < 1:
        raise UserError("too few steps to measure throughput: use --steps >= --warmup-steps + 2")
    return spec.batch * (len(ends) - w) / (ends[-1] - ends[w - 1])


def run_plan(plan: dict, *, catalogue: str | None = None, profile: str | None = None, run_dir: str | None = None,
             timeout: float = 30.0, quiet: bool = False, **opts) -> dict:
    """Compile, launch and measure one plan. Returns the result dict (also for bench/)."""
    from ..cluster.spec import parse_cluster
    from ..runtime.env import CommConfig
    from ..runtime.launch import LaunchConfig, launch

    run = Path(run_dir or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
    run.mkdir(parents=True, exist_ok=True)
    opts.setdefault("ckpt_dir", str(run / "ckpt"))
    opts["metrics_dir"] = str(run / "metrics")
    if Path(opts["metrics_dir"]).is_dir():
        for f in Path(opts["metrics_dir"]).glob("rank*.json"):
            f.unlink()
    spec, score, cat = compile_plan(plan, catalogue, profile, **opts)
    if any(st.device == "cuda" for st in spec.stages):
        from .devicemap import check_host, cuda_devices

        check_host(spec.stages, cuda_devices())  # before any process starts
    spec_path = run / "spec.json"
    spec_path.write_text(spec.to_json())
    cluster = parse_cluster(cluster_for(spec, cat), "<generated by hetrain train>")
    cfg = LaunchConfig(cluster=cluster, argv=["-m", "hetrain.pipeline.worker", "--spec", str(spec_path)],
                       comm=CommConfig(mode=Mode.ALLREDUCE, timeout_s=timeout), run_dir=str(run / "launch"),
                       quiet=quiet)
    rc = launch(cfg)
    result = {"rc": rc, "run_dir": str(run), "predicted_sps": score.throughput,
              "price_per_hour": float(sum(st.hourly for st in score.stages)),
              "stages": [{"layers": [s.start, s.end], "type": s.type, "instances": s.instances,
                          "device": s.device, "time_per_sample_s": s.time_per_sample_s} for s in spec.stages],
              "emulated": spec.emulate, "real_devices": any(s.device != "emulated" for s in spec.stages),
              "processes": spec.world_size, "ps_shards": spec.ps_shards, "micro_batches": spec.micro_batches}
    if rc != 0:
        return result
    metrics = [json.loads(p.read_text()) for p in sorted(Path(spec.metrics_dir).glob("rank*.json"))]
    result["measured_sps"] = measured_throughput(spec, metrics)
    result["cost_per_sample"] = result["price_per_hour"] / 3600.0 / result["measured_sps"]
    result["over_target"] = sum(m.get("over_target", 0) for m in metrics)
    last = [m for m in metrics if m.get("role", "").startswith(f"stage{len(spec.stages) - 1}/")]
    if last and last[0]["loss"]:
        result["final_loss"] = float(np.mean([m["loss"][-1] for m in last]))
    return result


def run(args: argparse.Namespace) -> int:
    from ..plan.render import load_plan

    plan = load_plan(args.plan)
    opts = dict(steps=args.steps, warmup_steps=args.warmup_steps, micro_batches=args.micro_batches,
                ps_shards=args.ps_shards, ps_memory=args.ps_memory, emulate=not args.no_emulate,
                devices=args.devices,
                optim={"kind": args.optimizer, "lr": args.lr}, ckpt_every=args.ckpt_every, resume=args.resume)
    if args.ckpt_dir:
        opts["ckpt_dir"] = args.ckpt_dir
    if args.fail_at:
        r, _, s = args.fail_at.partition(":")
        if not (r.isdigit() and s.isdigit()):
            raise UserError(f"--fail-at must be RANK:STEP (two non-negative integers), got {args.fail_at!r}")
        opts["fail_rank"], opts["fail_step"] = int(r), int(s)
    res = run_plan(plan, catalogue=args.catalogue, profile=args.profile, run_dir=args.run_dir,
                   timeout=args.timeout, quiet=args.quiet, **opts)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if res["rc"] != 0:
        print(f"hetrain: training failed (launcher exit {res['rc']}); logs in {res['run_dir']}. "
              f"Restart with --resume (and the same --run-dir or --ckpt-dir) to continue from the last "
              f"complete checkpoint.", file=sys.stderr)
        return res["rc"]
    for i, s in enumerate(res["stages"]):
        on = "" if s["device"] == "emulated" else f" (real {s['device']})"
        print(f"stage {i}: layers {s['layers'][0]}..{s['layers'][1] - 1} on {s['type']} x{s['instances']}{on}")
    m, p = res["measured_sps"], res["predicted_sps"]
    print(f"throughput: measured {m:,.1f} samples/s, cost model {p:,.1f} samples/s ({(m / p - 1) * 100:+.1f}%); "
          f"{res['processes']} processes incl. {res['ps_shards']} sparse-PS shards; "
          f"${res['price_per_hour']:.2f}/hour, ${res['cost_per_sample'] * 1e6:.3f} per million samples "
          + ("(compute and link times emulated from the profile; see docs/heterps-runtime.md)" if res["emulated"]
             else "(real devices, unpadded; see docs/heterps-runtime.md)" if res["real_devices"]
             else "(emulated devices without padding: a correctness run)"))
    return 0
