"""An emulated commodity cluster on one machine: one network namespace per rank, shaped links.

Each rank gets its own Linux network namespace with one interface, ``eth0``, joined by a veth
pair to a bridge that lives in a namespace of its own (the "switch"), so nothing in the host's
network is touched. Every rank's ``eth0`` is shaped with ``tc`` (token bucket filter) to the link
rate, and gloo is bound to it (``GLOO_SOCKET_IFNAME=eth0``), so collectives really cross a link
of that speed, as between machines on a 100 Mbit/s–10 Gbit/s network.

Addresses come from a private /24 that exists only inside these namespaces. Everything made is
removed on exit, on error and on SIGINT/SIGTERM; namespaces left over by a killed run (same
prefix, or a prefix of :func:`own_prefix` whose process is gone) are removed before a new one
starts. It needs root and iproute2 (``ip``, ``tc``): without them :func:`available` says why,
and callers fall back to plain loopback.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import List, Optional

PREFIX = "gzemu"
SUBNET = "10.254.77"  # /24 inside the emulated cluster's own namespaces only
IFACE = "eth0"


def parse_rate(rate: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"10gbit"``, ``"500kbit"`` → bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m or m.group(1).count(".") > 1 or float(m.group(1)) <= 0:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 10gbit (above 0), got {rate!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def available() -> Optional[str]:
    """None when an emulated cluster can be built here, else the reason it cannot."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _namespaces(prefix: str) -> List[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def own_prefix(tag: str) -> str:
    """The namespace prefix of this process's own clusters of kind ``tag`` (one letter), after
    removing those of processes no longer alive (left over from a killed run).

    Namespace names are global, and a cluster clears every namespace of its prefix when it
    starts, so each run takes a prefix with its process id: runs at once (two demos, a test
    suite in several workers) never take down each other's."""
    runs = (re.match(rf"gz{tag}(\d+)x", name) for name in _namespaces(f"gz{tag}"))
    for pid in {int(m.group(1)) for m in runs if m}:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # its run is gone
            EmulatedCluster.cleanup(f"gz{tag}{pid}x")
        except PermissionError:
            pass
    return f"gz{tag}{os.getpid()}x"


class EmulatedCluster:
    """``with EmulatedCluster(4, "1gbit") as c:`` — ``c.namespaces[k]``, ``c.address(k)``.

    ``nodes`` namespaces (hosts); with ``ranks_per_node=L`` each holds L ranks (rank r in node
    ``r // L``), which reach each other inside it without crossing the shaped link, as the ranks
    of one machine do: :meth:`namespace_of` says where a rank runs.
    """

    def __init__(
        self, nodes: int, rate: str = "1gbit", prefix: str = PREFIX, latency_ms: float = 0.0, ranks_per_node: int = 1,
    ) -> None:
        if nodes < 1 or nodes > 250:
            raise ValueError(f"nodes must be in 1..250, got {nodes}")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.latency_ms = latency_ms
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.namespaces = [f"{prefix}{k}" for k in range(nodes)]
        self.iface = IFACE  # each rank's interface inside its namespace (gloo binds to it)
        self._old_handlers: dict = {}
        self._up = False

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def namespace_of(self, rank: int) -> str:
        """The namespace (node) rank ``rank`` runs in."""
        return self.namespaces[rank // self.ranks_per_node]

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "EmulatedCluster":
        reason = available()
        if reason:
            raise RuntimeError(f"cannot emulate a cluster here: {reason}")
        self.cleanup(self.prefix)  # leftovers of a killed run
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self._up = True
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup(self.prefix)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        self._up = False

    def _on_signal(self, signum, frame) -> None:
        self.cleanup(self.prefix)
        handler = self._old_handlers.get(signum)
        if callable(handler):
            handler(signum, frame)
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    @staticmethod
    def cleanup(prefix: str = PREFIX) -> List[str]:
        """Delete every namespace whose name starts with ``prefix`` (their veths and bridge go too)."""
        removed = []
        for ns in _namespaces(prefix):
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
        return removed

    def _build(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for r, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # one veth pair: eth0 inside the rank's namespace, port{r} on the switch's bridge
            _run("ip", "-n", ns, "link", "add", IFACE, "type", "veth", "peer", "name", f"port{r}", "netns", sw)
            _run("ip", "-n", sw, "link", "set", f"port{r}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"port{r}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            self._shape(ns, IFACE)

    def _shape(self, ns: str, dev: str) -> None:
        """Token bucket on the rank's egress: its link sends at most ``rate``."""
        burst = max(32 * 1024, int(self.rate_bps / 8 / 250))  # ≥ 4 ms of traffic, as tc advises
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        if self.latency_ms:
            _run(*cmd, "handle", "1:", "netem", "delay", f"{self.latency_ms}ms")
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
        _run(*cmd, "tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", "100ms")

    def describe(self) -> str:
        if self.ranks_per_node > 1:
            return (
                f"{self.nodes} nodes x {self.ranks_per_node} ranks in network namespaces, nodes joined by links "
                f"shaped to {self.rate} (tc tbf), ranks of a node on its loopback"
            )
        return f"{self.world_size} ranks in network namespaces, links shaped to {self.rate} (tc tbf)"

