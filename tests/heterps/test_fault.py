"""A lost stage process stops the job with an error that names it; `--resume` restarts
from the last complete checkpoint and ends where an uninterrupted run ends. The lost
process is a replica of a stage whose replicas average dense gradients with push_pull
on their stage's group (interaction + first top layer, fan-out 1->2 and fan-in 2->1)."""
from torch.testing import assert_close

from hetrain.pipeline.reference import assemble, train_single
from hetrain.pipeline.spec import RunSpec
from tests.heterps.helpers import make_plan, train

ARGS = ("--steps", "5", "--micro-batches", "8", "--optimizer", "sgd", "--lr", "0.5", "--no-emulate",
        "--ckpt-every", "1", "--timeout", "8")


def test_lost_stage_process_is_named_and_resume_restores(tmp_path):
    plan = make_plan([((0, 5), "cpu", "cpu", 1), ((5, 12), "gpu-k80", "gpu", 2), ((12, 14), "cpu", "cpu", 1)])
    # rank 1 = stage 1 replica 0 (machine s1r0) dies after finishing step 2
    rc, out, run = train(tmp_path, plan, *ARGS, "--fail-at", "1:2")
    assert rc != 0, out
    assert "rank 1 (worker on machine s1r0) failed (killed by SIGKILL)" in out, out
    assert "Restart with --resume" in out
    # the survivors say whom they lost, too (not just a gloo timeout)
    assert "PeerLostError" in out and "lost rank 1 (worker on machine s1r0)" in out, out
    spec = RunSpec.load(run / "spec.json")
    from hetrain.pipeline.checkpoints import latest_complete
    last = latest_complete(spec)
    assert last == 2, f"newest complete checkpoint is step {last}"
    # the checkpoint holds exactly the state after 2 steps of training
    ref2 = train_single(spec, steps=2)
    for (n, a), (_, b) in zip(ref2.named_parameters(), assemble(spec, 2).named_parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")

    rc, out, run = train(tmp_path, plan, *ARGS, "--resume", "--json", str(tmp_path / "r.json"))
    assert rc == 0, out
    assert "resuming from the checkpoint of step 2" in out
    spec = RunSpec.load(run / "spec.json")
    ref5 = train_single(spec, steps=5)
    for (n, a), (_, b) in zip(ref5.named_parameters(), assemble(spec, 5).named_parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
