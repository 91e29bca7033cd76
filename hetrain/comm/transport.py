"""The transports (comm/transports/): how a worker moves the partitions of one push_pull.
This module keeps the names where the engine and the tests import them."""
from __future__ import annotations

from .transports import (AllReduceTransport, Arrival, HierarchicalTransport, ServerLeg, ServerTransport,  # noqa: F401
                         Transport, make_transport)
