"""`hetrain.elastic`: elastic training (restart from the last commit).

hetrain's own names (`State`, `run`, `load_committed`...) are those of
`hetrain.train.elastic`; Horovod Elastic's (`TorchState`, `ObjectState`,
`ElasticSampler`, `HostsUpdatedInterrupt`, `register_reset_callbacks`) come from
`hetrain.api.elastic`, so `import hetrain.elastic` and `hvd.elastic.TorchState` both work.
`run` is Horovod's form, which also calls the reset callbacks of a Horovod-style state.
"""
from __future__ import annotations

from .api.elastic import ElasticSampler, HostsUpdatedInterrupt, ObjectState, TorchState, run
from .train.elastic import EXIT_RESIZE, EXIT_STOPPED, State, StopAtCommit, load_committed, on_stop_request

__all__ = ["EXIT_RESIZE", "EXIT_STOPPED", "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State",
           "StopAtCommit", "TorchState", "load_committed", "on_stop_request", "run"]
