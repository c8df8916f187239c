"""A lab WAN on one Linux machine: one network namespace per site, joined by bandwidth-shaped links.

Layout (``<id>`` is the owning process id, so concurrent labs never collide)::

    netns mdc<id>-s0  [wan0 10.213.0.10/24] --veth-- [h0] \\
    netns mdc<id>-s1  [wan0 10.213.0.11/24] --veth-- [h1] -+- bridge br0 in netns mdc<id>-wan
    ...

Every site-to-site packet crosses two ``tbf`` qdiscs: the site's own ``wan0`` egress (its upload) and the
bridge port ``h<i>`` egress (its download), both shaped to ``rate``. Traffic between ranks of the same site
stays on that namespace's loopback, unshaped. Only addresses inside these namespaces are used; the host's
namespace is untouched. ``netem`` is not assumed, so the lab emulates bandwidth, not latency.

Needs root and iproute2 (``ip``, ``tc``). ``Lab`` is a context manager: the namespaces are removed on exit,
on exceptions, on Ctrl-C and on SIGTERM (a handler turns SIGTERM into ``SystemExit`` so ``finally`` runs), and
namespaces left behind by a killed lab process are swept when the next lab starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

SITE_IFACE = "wan0"
_SUBNET = "10.213.0"
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(rate: str) -> float:
    """``"400mbit"`` -> 4e8 bits per second. ValueError with the accepted forms otherwise."""
    match = _RATE.match(str(rate))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"WAN rate {rate!r} is not understood; write a positive number with a unit: "
                         f"'400mbit', '1gbit', '50000kbit'.")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def lab_available() -> str | None:
    """``None`` when a lab can be built here, else the reason it cannot (not root, no ``ip``/``tc``)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the lab WAN needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the lab WAN needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the lab WAN needs iproute2; missing {missing}"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"lab command failed ({' '.join(argv)}): {result.stderr.strip() or result.stdout}")
    return result


def _sweep_stale() -> None:
    """Remove namespaces of lab processes that died without tearing down (e.g. SIGKILL)."""
    names = _sh("ip", "netns", "list", check=False).stdout.split()
    for name in names:
        match = re.fullmatch(r"mdc(\d+)-(s\d+|wan)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _sh("ip", "netns", "del", name, check=False)


@dataclass
class Lab:
    """Sites as network namespaces with a shaped WAN between them. Use as ``with Lab(2, "400mbit") as lab:``.

    Args:
        num_sites: namespaces to create (2 to 200).
        rate: per-direction bandwidth of each site's WAN link, e.g. ``"400mbit"``; ``None`` leaves it unshaped.
    """

    num_sites: int
    rate: str | None = None
    _id: int = field(default_factory=os.getpid, init=False)
    _created: list[str] = field(default_factory=list, init=False, repr=False)
    _old_sigterm: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.num_sites, int) or not 2 <= self.num_sites <= 200:
            raise ValueError(f"Lab num_sites={self.num_sites!r} must be an integer from 2 to 200.")
        self.rate_bps = parse_rate(self.rate) if self.rate is not None else None

    # -- names and addresses -------------------------------------------------------------------------------
    def netns(self, site: int) -> str:
        return f"mdc{self._id}-s{site}"

    @property
    def wan_netns(self) -> str:
        return f"mdc{self._id}-wan"

    def site_ip(self, site: int) -> str:
        return f"{_SUBNET}.{10 + site}"

    def wrap(self, site: int, argv: list[str]) -> list[str]:
        """``argv`` run inside ``site``'s namespace."""
        return ["ip", "netns", "exec", self.netns(site), *argv]

    @property
    def hub_ip(self) -> str:
        """An address on the WAN's bridge, reached by every site over its WAN link (e.g. for a lighthouse)."""
        return f"{_SUBNET}.2"

    def wrap_hub(self, argv: list[str]) -> list[str]:
        """``argv`` run on the WAN's bridge (address ``hub_ip``): a service every site reaches, none holds."""
        return ["ip", "netns", "exec", self.wan_netns, *argv]

    # -- lifecycle -----------------------------------------------------------------------------------------
    def __enter__(self) -> Lab:
        reason = lab_available()
        if reason:
            raise RuntimeError(f"cannot build the lab WAN: {reason}.")
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            _sweep_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this lab made (their veths and qdiscs go with them). Idempotent."""
        errors = []
        for name in reversed(self._created):
            result = _sh("ip", "netns", "del", name, check=False)
            if result.returncode != 0 and name in _sh("ip", "netns", "list", check=False).stdout.split():
                errors.append(f"{name}: {result.stderr.strip()}")
        self._created.clear()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if errors:
            raise RuntimeError(f"lab teardown left namespaces behind; remove them with `ip netns del`: {errors}")

    def _add_netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        wan = self.wan_netns
        self._add_netns(wan)
        _sh("ip", "-n", wan, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", wan, "link", "set", "br0", "up")
        _sh("ip", "-n", wan, "addr", "add", f"{self.hub_ip}/24", "dev", "br0")
        for site in range(self.num_sites):
            ns = self.netns(site)
            self._add_netns(ns)
            port = f"h{site}"
            _sh("ip", "-n", wan, "link", "add", port, "type", "veth", "peer", "name", SITE_IFACE, "netns", ns)
            _sh("ip", "-n", wan, "link", "set", port, "master", "br0")
            _sh("ip", "-n", wan, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.site_ip(site)}/24", "dev", SITE_IFACE)
            _sh("ip", "-n", ns, "link", "set", SITE_IFACE, "up")
            if self.rate_bps is not None:
                self._shape(ns, SITE_IFACE)
                self._shape(wan, port)

    def _shape(self, ns: str, dev: str) -> None:
        # burst must cover one kernel tick at full rate or tbf cannot reach its rate; 4 ms of traffic is ample.
        burst = max(int(self.rate_bps / 8 * 0.004), 64 * 1024)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", "50ms")

    def set_rate(self, rate: str) -> None:
        """Re-shape every site's WAN link, both directions, to ``rate`` (e.g. ``"100mbit"``) while jobs run on it
        (``tc qdisc replace``: connections stay up). A lab built unshaped (``rate=None``) is shaped from now on."""
        self.rate, self.rate_bps = rate, parse_rate(rate)
        for site in range(self.num_sites):
            self._shape(self.netns(site), SITE_IFACE)
            self._shape(self.wan_netns, f"h{site}")

    # -- faults and counters -------------------------------------------------------------------------------
    def set_link(self, site: int, up: bool) -> None:
        """Cut (``up=False``) or restore ``site``'s WAN link, as a failed interconnect would."""
        _sh("ip", "-n", self.wan_netns, "link", "set", f"h{site}", "up" if up else "down")

    def tx_bytes(self, site: int) -> int:
        """Bytes ``site`` has sent over its WAN link (interface counter, headers included)."""
        return _read_counter(self.netns(site), SITE_IFACE, "tx_bytes")


def _read_counter(ns: str, dev: str, name: str) -> int:
    out = _sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/{name}").stdout
    return int(out.strip())


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
