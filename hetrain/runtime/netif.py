"""Find the network interface that carries an IP address, so gloo binds only there."""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def iface_for_address(address: str) -> str | None:
    """Name of the local interface holding `address` (IPv4), or None."""
    if ipaddress.ip_address(address).is_loopback:  # 127.x and ::1
        return "lo"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    finally:
        sock.close()
    return None
