"""The listening TCP sockets of a process tree, read from /proc (Linux): for the tests that hold a
running job to the table of docs/security.md."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path


def _tree(root: int) -> list[int]:
    """``root`` and every descendant (by /proc/<pid>/stat's parent field)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


def _address(hex_addr: str, family: int) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if family == socket.AF_INET:
        raw = struct.pack("<I", struct.unpack(">I", raw)[0])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, 16, 4))
    return socket.inet_ntop(family, raw), int(port, 16)


def listening(root: int) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) of every TCP socket it listens on, over ``root``'s process tree."""
    inodes: dict[str, int] = {}
    for pid in _tree(root):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:  # gone meanwhile
            continue
    out: dict[int, list[tuple[str, int]]] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.setdefault(inodes[fields[9]], []).append(_address(fields[1], family))
    return out
