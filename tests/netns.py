"""Two test "hosts" on one machine: network namespaces joined by a veth pair, each with its own address on a
private /24 that only the test uses, its own hostname (a UTS namespace per command) and no route anywhere
else. Needs root and iproute2 (``ip netns``); :func:`unavailable` says why not where they are missing.

Each node runs its commands through ``ip netns exec NS unshare --uts``; the processes share the machine's
filesystem and pid space, as nodes with a shared filesystem do. ``cut(node)`` takes a node's link down (a
network partition), ``kill(node)`` SIGKILLs every process inside its namespace; ``close()`` kills what is
left in the namespaces (only processes this fixture started live there) and deletes them, which removes
the veth pair.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why two namespaces cannot be created here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's `ip` and util-linux's `unshare` on the PATH"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"pp-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoHosts:
    """``node0`` and ``node1`` (hostnames), addresses ``addr[0]`` and ``addr[1]`` on interfaces ``ifname[i]``."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.ns = [f"pp{tag}n0", f"pp{tag}n1"]
        self.ifname = [f"pp{tag}v0", f"pp{tag}v1"]
        self.hostname = ["node0", "node1"]
        subnet = 10 + tag % 240  # 10.213.<subnet>.0/24: private, chosen per run so parallel runs do not meet
        self.addr = [f"10.213.{subnet}.1", f"10.213.{subnet}.2"]
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.ifname[0], "type", "veth", "peer", "name", self.ifname[1])
            for i in range(2):
                _ip("link", "set", self.ifname[i], "netns", self.ns[i])
                _ip("-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.ifname[i])
                _ip("-n", self.ns[i], "link", "set", self.ifname[i], "up")
                _ip("-n", self.ns[i], "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def env(self, node: int, base: dict) -> dict:
        """The environment a cluster user sets on node ``node``: gloo on the cluster interface."""
        return {**base, "GLOO_SOCKET_IFNAME": self.ifname[node]}

    def command(self, node: int, argv: list[str], local: tuple[str, ...] = (),
                disks: dict[str, str] | None = None) -> list[str]:
        """``argv`` run on node ``node``: inside its namespace, under its own hostname. Each folder in
        ``local`` becomes node-local there (an empty tmpfs mounted over it in a private mount namespace):
        the node sees its own disk at that path, as nodes without a shared filesystem do. ``disks`` maps a
        folder to the node's own "disk" (another folder, bind-mounted over it in the private namespace):
        node-local too, but it outlives the command, so a later command on the node sees what it wrote."""
        mounts = "".join(f"mount -t tmpfs pp-local '{path}' && " for path in local)
        mounts += "".join(f"mount --bind '{disk}' '{path}' && " for path, disk in (disks or {}).items())
        private = ["--mount"] if local or disks else []
        return ["ip", "netns", "exec", self.ns[node], "unshare", "--uts", *private,
                "sh", "-c", f'{mounts}hostname {self.hostname[node]} && exec "$@"', "sh", *argv]

    def pids(self, node: int) -> list[int]:
        out = _ip("netns", "pids", self.ns[node], check=False).stdout
        return [int(p) for p in out.split()]

    def cut(self, node: int) -> None:
        _ip("-n", self.ns[node], "link", "set", self.ifname[node], "down")

    def reconnect(self, node: int) -> None:
        _ip("-n", self.ns[node], "link", "set", self.ifname[node], "up")

    def kill(self, node: int) -> None:
        for _ in range(20):  # a dying launcher may still fork; repeat until the namespace is empty
            pids = self.pids(node)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def close(self) -> None:
        for node, ns in enumerate(self.ns):
            if _ip("netns", "pids", ns, check=False).returncode == 0:
                self.kill(node)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.ifname[0], check=False)  # only if it never moved into a namespace
