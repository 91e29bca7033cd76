"""Emulated machines as Linux network namespaces joined by a bridge, with each link
shaped both ways by `tc tbf` (upload on the namespace side, download on the bridge
side). Everything created is removed on exit, also after an error or a signal.

Names carry a per-job slot so two jobs can coexist; a record under /run/hetrain lets
`hetrain netns cleanup` remove what a killed launcher left behind.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .spec import ClusterSpec

RECORDS = Path("/run/hetrain/netns")


class NetnsUnavailable(UserError):
    """Namespaces cannot be made here (not root, or no `ip`/`tc`)."""


def netns_available() -> str | None:
    """None if namespaces can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"hetprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"network emulation: `{' '.join(cmd)}` failed: {r.stderr.strip()}")


def _rate(bytes_per_s: float) -> str:
    return f"{max(1, int(bytes_per_s * 8 / 1000))}kbit"


@dataclass
class NetnsCluster:
    """A live emulated network: one namespace per machine of `cluster`."""

    cluster: ClusterSpec
    slot: int = field(default_factory=lambda: random.randint(1, 250))
    namespaces: dict[str, str] = field(default_factory=dict)  # machine -> namespace
    qdisc_used: str = "fifo"
    addresses: dict[str, str] = field(default_factory=dict)  # machine -> IP
    _created: list[list[str]] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"hetbr{self.slot}"

    @property
    def host_address(self) -> str:
        """The bridge's address in the root namespace: where the launcher's store listens."""
        return f"10.79.{self.slot}.254"

    def up(self) -> ClusterSpec:
        """Create everything; return the cluster with machines' addresses rewritten."""
        reason = netns_available()
        if reason:
            raise NetnsUnavailable(f"cannot emulate links with namespaces: {reason}; use `network: {{emulate: ratelimit}}`")
        if len(self.cluster.machines) > 250:
            raise UserError("netns emulation supports at most 250 machines")
        RECORDS.mkdir(parents=True, exist_ok=True)
        (RECORDS / f"{self.slot}").write_text(str(os.getpid()))
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._created.append(["ip", "link", "del", self.bridge])
            _run(["ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            machines = []
            for i, m in enumerate(self.cluster.machines):
                ns, inner, outer = f"het{self.slot}m{i}", f"hv{self.slot}m{i}", f"hp{self.slot}m{i}"
                addr = f"10.79.{self.slot}.{i + 1}"
                _run(["ip", "netns", "add", ns])
                self._created.append(["ip", "netns", "del", ns])
                _run(["ip", "link", "add", inner, "type", "veth", "peer", "name", outer])
                self._created.append(["ip", "link", "del", outer])
                _run(["ip", "link", "set", inner, "netns", ns])
                _run(["ip", "link", "set", outer, "master", self.bridge])
                mtu = str(self.cluster.network.mtu)
                _run(["ip", "link", "set", outer, "mtu", mtu])
                _run(["ip", "-n", ns, "link", "set", inner, "mtu", mtu])
                _run(["ip", "link", "set", outer, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inner])
                _run(["ip", "-n", ns, "link", "set", inner, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                rate = _rate(m.bandwidth)
                burst = f"{max(64, int(m.bandwidth / 250 / 1024))}kb"
                for cmd in (["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner],
                            ["tc", "qdisc", "add", "dev", outer]):
                    self._shape(cmd, rate, burst)
                self.namespaces[m.name] = ns
                self.addresses[m.name] = addr
                machines.append(m.model_copy(update={"address": addr}))
        except BaseException:
            self.down()
            raise
        return self.cluster.model_copy(update={"machines": tuple(machines)})

    def _shape(self, cmd: list[str], rate: str, burst: str) -> None:
        net = self.cluster.network
        parent = ["root"]
        if net.latency_ms > 0:
            r = subprocess.run(cmd + ["root", "handle", "1:", "netem", "delay", f"{net.latency_ms / 2}ms"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise UserError(f"latency_ms needs the kernel's netem qdisc (sch_netem), which this host lacks "
                                f"({r.stderr.strip()}); set network.latency_ms: 0")
            parent = ["parent", "1:1"]
        _run(cmd + parent + ["handle", "10:", "tbf", "rate", rate, "burst", burst, "latency", f"{net.queue_ms:g}ms"])
        if net.qdisc == "fifo":
            return
        # tbf alone is one deep FIFO: a NIC that sends and receives at full rate queues
        # its ACKs behind the data and slows its own downloads. fq_codel (Linux's default
        # qdisc) keeps queues short and serves sparse flows such as ACK streams first.
        r = subprocess.run(cmd + ["parent", "10:1", "handle", "20:", "fq_codel"], capture_output=True, text=True)
        if r.returncode != 0:
            if net.qdisc == "fq_codel":
                raise UserError(f"network.qdisc: fq_codel is not available on this kernel ({r.stderr.strip()}); "
                                "use qdisc: auto or fifo")
            self.qdisc_used = "fifo"
        else:
            self.qdisc_used = "fq_codel"

    def down(self) -> None:
        for cmd in reversed(self._created):
            subprocess.run(cmd, capture_output=True)
        self._created.clear()
        (RECORDS / f"{self.slot}").unlink(missing_ok=True)

    def link(self, machine: str) -> tuple[str, str]:
        """(namespace, bridge-side veth) of a machine: where a link can be cut."""
        ns = self.namespaces[machine]
        return ns, "hp" + ns[len("het"):]

    def link_up(self, machine: str) -> bool:
        """Whether the machine's emulated link carries traffic: the bridge end is up
        and the namespace end has carrier (`ip link set ... down` on either end clears it)."""
        if machine not in self.namespaces:
            return False
        ns, outer = self.link(machine)
        inner = "hv" + outer[2:]
        a = subprocess.run(["ip", "-o", "link", "show", "dev", outer], capture_output=True, text=True).stdout
        b = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", inner], capture_output=True, text=True).stdout
        return all("LOWER_UP" in out and ",UP" in out for out in (a, b))

    def wrap(self, machine: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[machine], *argv]

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def cleanup_stale() -> list[int]:
    """Remove namespaces and links of launchers that no longer run; returns their slots."""
    removed = []
    if not RECORDS.is_dir():
        return removed
    for rec in RECORDS.iterdir():
        try:
            pid = int(rec.read_text())
            os.kill(pid, 0)
            continue  # still running
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        slot = rec.name
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            ns = line.split()[0] if line.split() else ""
            if ns.startswith(f"het{slot}m"):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"hp{slot}m"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", f"hetbr{slot}"], capture_output=True)
        rec.unlink(missing_ok=True)
        removed.append(int(slot))
    return removed
