"""Cluster description, the hardware vocabulary, emulation of uneven devices and links."""
from .hardware import DeviceKind, HardwareError, Inventory, Speed
from .spec import ClusterSpec, ClusterSpecError, DeviceSpec, MachineSpec, default_cluster, load_cluster, parse_cluster

__all__ = ["ClusterSpec", "ClusterSpecError", "DeviceKind", "DeviceSpec", "HardwareError", "Inventory",
           "MachineSpec", "Speed", "default_cluster", "load_cluster", "parse_cluster"]
