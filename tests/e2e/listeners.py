"""The listening TCP sockets of a process tree, read from /proc (Linux): for the tests that hold a
running job to the table of docs/security.md."""

from __future__ import annotations

import os
import socket
import struct
import threading
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
    return listening_of(_tree(root))


def listening_of(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) of every TCP socket it listens on, for each of ``pids`` (a socket
    shared by several processes, e.g. inherited over fork, is listed under one of them)."""
    inodes: dict[str, int] = {}
    for pid in pids:
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


def job_pids(job_id: int) -> list[int]:
    """Every process of SLURM job ``job_id`` on this machine: those whose environment names the job
    (srun exports SLURM_JOB_ID to every task, and their children inherit it). Processes of other
    users cannot be read and are skipped (the tests' jobs run as the tests' user)."""
    needle = f"\0SLURM_JOB_ID={job_id}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in b"\0" + (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def command_line(pid: int) -> str:
    """``pid``'s command line, arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class JobListeners:
    """Samples every listening socket of a running SLURM job in a background thread, so sockets that
    exist only for a while (a transfer group forming, a checkpoint's helpers) are seen too.
    ``found`` maps (address, port, command line) to the number of samples that saw it."""

    def __init__(self, job_id: int, *, every_s: float = 0.5):
        self.job_id, self.every_s = job_id, every_s
        self.found: dict[tuple[str, int, str], int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> JobListeners:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        commands: dict[int, str] = {}  # read once, when a pid is first seen (an exiting process has none)
        while not self._stop.is_set():
            pids = job_pids(self.job_id)
            for pid in pids:
                if pid not in commands:
                    commands[pid] = command_line(pid)
            for pid, ports in listening_of(pids).items():
                for host, port in ports:
                    key = (host, port, commands[pid])
                    self.found[key] = self.found.get(key, 0) + 1
            self.samples += 1
            self._stop.wait(self.every_s)


# ----------------------------------------------------------------------------- docs/security.md's table

ANY = ("0.0.0.0", "::")


def table(doc: str) -> dict[str, list[str]]:
    """The rows of the listener table of docs/security.md: row id (the first cell, in backticks) ->
    the other cells (process and address, bound to, who can connect, protection, unpickled?)."""
    section = doc.split("## Every listening socket of a running job", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 6:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def bound_as(host: str, node_addresses: set[str]) -> set[str]:
    """What docs/security.md's "bound to" cell may say of a socket on ``host`` (on the local test
    cluster every node's address is 127.0.0.1, so such a socket is both)."""
    kinds = set()
    if host in ANY:
        kinds.add("every interface")
    if host.startswith("127.") or host == "::1":
        kinds.add("loopback")
    if host in node_addresses:
        kinds.add("node address")
    return kinds


def row_of(command: str, host: str, port: int, *, master_port: int, rollout_port: int) -> str | None:
    """The row of docs/security.md's table a listening socket of a train.sbatch job belongs to, from
    the process that holds it; None for a process the table does not know."""
    if command.startswith("srun "):
        return "srun"
    if "torch.distributed.run" in command:  # the static rendezvous: its one store, on MASTER_PORT
        return "torchrun-store" if port == master_port else None
    if "megatron_gtpo.cli.worker" in command:
        return "trainer-gloo"
    if "rollout-server" in command:
        if port == rollout_port:
            return "rollout-port"
        return "vllm-world" if host.startswith("127.") else "transfer-gloo"
    return None
