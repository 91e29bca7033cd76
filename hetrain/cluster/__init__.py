"""Cluster description, emulation of uneven devices and links."""
from .spec import ClusterSpec, ClusterSpecError, DeviceSpec, MachineSpec, default_cluster, load_cluster, parse_cluster

__all__ = ["ClusterSpec", "ClusterSpecError", "DeviceSpec", "MachineSpec", "default_cluster", "load_cluster", "parse_cluster"]
