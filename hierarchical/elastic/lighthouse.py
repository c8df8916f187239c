"""The torchft lighthouse, as multidc starts and reaches it.

One lighthouse serves the whole job: every site's rank 0 (torchft's per-replica-group manager) registers with it,
heartbeats, and asks it for the quorum of sites present. Run it on a host every site reaches (a small VM at one
site, or the site least likely to fail); its port must be open to every site.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import html
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import urllib.error
import urllib.request
from types import ModuleType

from multidc.hierarchical import _env

_LOG_LEVELS = {"error": "ERROR", "warn": "WARNING", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
               "trace": "DEBUG"}  # MULTIDC_TORCHFT_LOG_LEVEL -> the level of torchft's Python loggers
_PYTHON_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")  # torchft 0.2's


class LighthouseUnreachable(ConnectionError):
    """No lighthouse answers at the configured address."""


def import_torchft() -> ModuleType:
    """``torchft``, or an ImportError saying how to install it (elastic sites are the optional ``elastic`` extra).
    Its logging is at ``MULTIDC_TORCHFT_LOG_LEVEL`` (default ``warn``) if this is its first import (see
    ``torchft_logging``)."""
    try:
        with torchft_logging():
            import torchft
    except ImportError as exc:
        raise ImportError(
            "elastic sites run on torchft, which is not installed: pip install 'multidc[elastic]' (torchft 0.2)."
        ) from exc
    if not hasattr(torchft, "_torchft") and "torchft._torchft" in sys.modules:  # loaded by _torchft_native first
        torchft._torchft = sys.modules["torchft._torchft"]
    return torchft


def _torchft_native() -> ModuleType:
    """torchft's native extension (``LighthouseServer``, ``LighthouseClient``) without torchft's Python side, which
    imports torch (seconds on a busy host): a restarted lighthouse is back that much sooner. The module is the one
    ``import torchft`` uses later in the same process."""
    if "torchft._torchft" in sys.modules:
        return sys.modules["torchft._torchft"]
    spec = importlib.util.find_spec("torchft")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    paths = [path for folder in folders for suffix in importlib.machinery.EXTENSION_SUFFIXES  # the importer's order
             if os.path.isfile(path := os.path.join(folder, f"_torchft{suffix}"))]
    if not paths:
        return import_torchft()._torchft  # not installed (a clear ImportError), or laid out otherwise
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", paths[0])
    spec = importlib.util.spec_from_file_location("torchft._torchft", paths[0], loader=loader)
    with torchft_logging():  # pyo3's single-phase init runs the module's init (its logger) in module_from_spec
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    sys.modules["torchft._torchft"] = module
    return module


def torchft_log_level() -> str:
    """torchft's log level: ``MULTIDC_TORCHFT_LOG_LEVEL`` (``error``, ``warn``, ``info``, ``debug``, ``trace``),
    default ``warn``.

    Raises:
        ValueError: another value.
    """
    value = _env.read(_env.TORCHFT_LOG_LEVEL) or "warn"
    if value.lower() not in _LOG_LEVELS:
        raise ValueError(f"{_env.TORCHFT_LOG_LEVEL}={value!r} is not a log level: set error, warn, info, debug or "
                         f"trace (default warn), or unset it.")
    return "warn" if value.lower() == "warning" else value.lower()


@contextlib.contextmanager
def torchft_logging():
    """Around the first import of torchft's native extension: its logging at ``torchft_log_level()``.

    torchft 0.2's extension sets its Rust logger once, when it is imported, from ``RUST_LOG`` (unset or unknown:
    info, about six lines per step on a site's rank 0, and the lighthouse's every quorum with its members).
    ``RUST_LOG`` holds the level for that import only, so other Rust libraries keep the user's; a ``RUST_LOG`` the
    user set is kept when ``MULTIDC_TORCHFT_LOG_LEVEL`` is not (then torchft's Python loggers are left alone too).
    torchft's Python loggers get the same level unless the user set theirs or torchft gave them handlers (its
    OpenTelemetry export, ``TORCHFT_USE_OTEL``). A no-op once the extension is loaded."""
    if "torchft._torchft" in sys.modules:
        yield
        return
    level, before = torchft_log_level(), os.environ.get("RUST_LOG")
    ours = _env.read(_env.TORCHFT_LOG_LEVEL) is not None or before is None  # else the user's RUST_LOG rules
    if ours:
        os.environ["RUST_LOG"] = level
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RUST_LOG", None)
        else:
            os.environ["RUST_LOG"] = before
    for name in _PYTHON_LOGGERS if ours else ():
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET and not logger.handlers:
            logger.setLevel(_LOG_LEVELS[level])


def lighthouse_url(address: str | None = None) -> str:
    """``http://host:port`` for ``address`` (``host:port`` or a URL); default ``MULTIDC_LIGHTHOUSE``.

    Raises:
        ValueError: no address given and ``MULTIDC_LIGHTHOUSE`` unset, or not ``host:port``.
    """
    source = "lighthouse address"
    if address is None:
        address, source = _env.read(_env.LIGHTHOUSE), _env.LIGHTHOUSE
    if not address:
        raise ValueError(
            f"elastic sites need the lighthouse address: set {_env.LIGHTHOUSE}=host:port on every site (start the "
            f"lighthouse with `multidc lighthouse --bind 0.0.0.0:29510`)."
        )
    url = address if "://" in address else f"http://{address}"
    host_port = url.split("://", 1)[1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{source}={address!r} must be host:port (e.g. 10.0.0.5:29510) or http://host:port.")
    return f"http://{host_port}"


def check_lighthouse(address: str | None = None, *, timeout_s: float = 10.0) -> str:
    """Connect to the lighthouse (nothing is registered: no heartbeat, no quorum request). Returns its URL.

    Raises:
        ValueError: a malformed address, or none configured.
        LighthouseUnreachable: nothing answers within ``timeout_s``; the message names the address and what to do.
    """
    url = lighthouse_url(address)
    import_torchft()
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(url, connect_timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise LighthouseUnreachable(
            f"no torchft lighthouse answers at {url} (from {_env.LIGHTHOUSE} or the given address) within "
            f"{timeout_s:g} s: start it there (`multidc lighthouse --bind 0.0.0.0:PORT`), or fix the address, or "
            f"open the port between the sites. ({exc})"
        ) from exc
    return url


@dataclasses.dataclass(frozen=True)
class HeardReplica:
    """A replica group (an elastic site's member) the lighthouse has heard since it started."""

    replica_id: str
    """torchft's id: ``<site name>:<uuid>``, a new uuid per start of the site's manager."""
    heard_s_ago: float
    """Seconds since its last heartbeat (or quorum request) reached the lighthouse."""
    alive: bool
    """Heard within the lighthouse's heartbeat timeout: the lighthouse counts it as present."""
    address: str | None
    """Its torchft manager (``http://host:port``) if it is in the lighthouse's last quorum, else None."""

    @property
    def site(self) -> str:
        return self.replica_id.rpartition(":")[0] or self.replica_id


_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(.*?): seen ([0-9.eE+-]+)s ago\s*</li>', re.S)
_MEMBER = re.compile(r'<div class="member[^"]*">\s*<b>(.*?)</b>.*?Manager: (\S+?)\s*<br/>', re.S)


def heard_replicas(address: str | None = None, *, timeout_s: float = 10.0) -> list[HeardReplica]:
    """The replica groups the lighthouse has heard, from its status page (torchft 0.2's dashboard, ``/status`` on
    the lighthouse's port), without registering anything (no heartbeat, no quorum request, which would hold up the
    job's quorums).

    Raises:
        OSError: the lighthouse does not answer within ``timeout_s``.
        ValueError: it serves no such page (``address``: a malformed one, or none configured).
    """
    url = lighthouse_url(address)
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as the sites reach it: no HTTP proxy
    try:
        with direct.open(f"{url}/status", timeout=timeout_s) as response:
            page = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise ValueError(f"the lighthouse at {url} serves no status page: {exc}") from exc
    if "<h2>Heartbeats</h2>" not in page:
        raise ValueError(f"the lighthouse at {url} serves no heartbeat list at /status (checked against torchft "
                         f"0.2's): {page[:200]!r}")
    managers = {html.unescape(rid): html.unescape(addr) for rid, addr in _MEMBER.findall(page)}
    return [HeardReplica(replica_id=html.unescape(rid), heard_s_ago=float(age), alive=not old,
                         address=managers.get(html.unescape(rid)))
            for old, rid, age in _HEARTBEAT.findall(page)]


def start_lighthouse(bind: str, *, min_sites: int = 1, join_timeout_ms: int = 60_000, quorum_tick_ms: int = 100,
                     heartbeat_timeout_ms: int = 5_000):
    """Start torchft's lighthouse in this process (``LighthouseServer``); returns it (``.shutdown()`` stops it).

    Args:
        bind: ``host:port`` to listen on (port 0: any free port).
        min_sites: sites a quorum needs (torchft's ``min_replicas``); 1 lets a lone surviving site go on.
        join_timeout_ms: how long a new quorum waits for sites that heartbeat but have not asked to join.
        quorum_tick_ms: how often the lighthouse recomputes the quorum.
        heartbeat_timeout_ms: a site whose heartbeats stop this long is dropped from the next quorum.

    Raises:
        ValueError: a bad setting.
    """
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind {bind!r} must be host:port, e.g. 0.0.0.0:29510 (port 0: any free port).")
    for name, value in (("min_sites", min_sites), ("join_timeout_ms", join_timeout_ms),
                        ("quorum_tick_ms", quorum_tick_ms), ("heartbeat_timeout_ms", heartbeat_timeout_ms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    return _torchft_native().LighthouseServer(bind=bind, min_replicas=min_sites, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


def resolve_elastic(elastic: bool | None, lighthouse: str | None) -> bool:
    """Whether a front-end runs elastic: ``elastic``, else env ``MULTIDC_ELASTIC``. When it does, the lighthouse
    address (``lighthouse`` / ``MULTIDC_LIGHTHOUSE``) and torchft are checked here, at construction."""
    enabled = bool(_env.read_bool(_env.ELASTIC)) if elastic is None else bool(elastic)
    if enabled:
        lighthouse_url(lighthouse)
        import_torchft()
    return enabled
