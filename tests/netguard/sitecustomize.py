"""Refuse, in every Python process of the test session, connections to any address that is not this host.

conftest.py imports this module (the test process) and puts its folder first on PYTHONPATH, so every Python
subprocess (the CLI, servers) imports it too as `sitecustomize`. A refused connection fails at once with
ENETUNREACH (never a hang on 169.254.169.254) and is appended to $STREAMCTL_NETGUARD_LOG, which conftest
checks after every test: a test that tried to reach the outside fails, even when an SDK swallowed the error.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from typing import Any

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_local_cache: dict[str, bool] = {}


def _is_this_host(host: str) -> bool:
    """Loopback, unspecified, or an address of one of this machine's interfaces (it can be bound)."""
    if host in _local_cache:
        return _local_cache[host]
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    local = ip.is_loopback or ip.is_unspecified
    if not local and not ip.is_link_local:  # 169.254.x.x (metadata servers) is never ours
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.bind((host, 0))
            local = True
        except OSError:
            local = False
        finally:
            probe.close()
    _local_cache[host] = local
    return local


def _refuse(sock: socket.socket, address: Any) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
        return False
    if _is_this_host(str(address[0])):
        return False
    log = os.environ.get("STREAMCTL_NETGUARD_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(f"pid {os.getpid()}: connect to {address[0]}:{address[1]}\n")
    return True


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if _refuse(self, address):
        raise OSError(errno.ENETUNREACH, f"test network guard: {address[0]} is not this host")
    _connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if _refuse(self, address):
        return errno.ENETUNREACH
    return _connect_ex(self, address)


socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]
