"""Horovod Elastic's names in one process (the launched restart is in
tests/test_ported_scripts.py): `import hetrain.elastic`, TorchState with positional model
and optimizer, ObjectState, reset callbacks, ElasticSampler's progress across a commit,
and HostsUpdatedInterrupt leaving with the resize exit code."""
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import hetrain
import hetrain.elastic as elastic
from hetrain.errors import UserError


def test_torch_state_sampler_and_interrupt(tmp_path):
    assert hetrain.elastic is elastic and elastic.State is hetrain.train.elastic.State
    model = nn.Linear(3, 2)
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sampler = elastic.ElasticSampler(TensorDataset(torch.arange(10.0)), shuffle=True, seed=4)
    state = elastic.TorchState(model, opt, directory=tmp_path, train_sampler=sampler, epoch=0, batch=0)
    assert state.model is model and state.optimizer is opt and state.train_sampler is sampler
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])
    with pytest.raises(UserError, match="not callable"):
        state.register_reset_callbacks([3])

    order = list(sampler)
    assert sorted(order) == list(range(10)) and len(sampler) == 10
    sampler.record_batch(0, 4)  # the first 4 samples of the epoch are done
    state.batch = 1
    state.commit()
    sampler.load_state_dict({"epoch": 0, "processed_indices": []})
    state.batch = 5
    state.restore()
    assert state.batch == 1 and list(sampler) == order[4:]  # resumes after the processed samples
    sampler.set_epoch(1)
    assert len(sampler) == 10 and list(sampler) != order

    @elastic.run
    def train(state):
        state.epoch = 2
        raise elastic.HostsUpdatedInterrupt(skip_sync=False)

    with pytest.raises(SystemExit) as stop:
        train(state)
    assert stop.value.code == elastic.EXIT_RESIZE and state.commits == 2
    assert calls == []  # the first round is no reset
    objects = elastic.ObjectState(directory=tmp_path / "o", best=0.5)
    objects.best = 0.7
    objects.save()
    objects.best = 0.1
    objects.restore()
    assert objects.best == 0.7
