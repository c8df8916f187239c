"""Region-local checkpoints: one store per site (each site's cloud region), one checkpoint across them.

The protocol, stated once here (the checkpoints guide links to it):

* **Where things go.** A job whose URL is a mapping ``site -> URL`` or a template with ``{site}`` keeps one
  ``ObjectStore`` per region (a region is named by its site's name). Each rank uploads its shard to its own site's
  region. Saving plans every site separately: state the ranks of a site hold alike (replicated: DDP replicas,
  DiLoCo's global parameters) is striped over that site's ranks and stored once per region, so every region holds
  all of it; what only a site holds (its own DiLoCo model, per-rank keys) is stored in that site's region only, and
  ranks of different sites that hold different values under one key each keep their own.
* **Copies (``replicas=N``).** The items of keys that only one region holds (a site's own state) are also written
  by the ranks that hold them to the ``N`` regions after theirs in site order (wrapping around), as
  ``data/copy-rank<r>.distcp``; these copies cross the WAN at save. A key that several regions hold is not copied.
* **Commit.** After every rank's upload succeeded, rank 0 writes the same commit record (``COMMIT.json``: for each
  region, the items stored there, copies included, and where) into every configured region, then its clean-up
  runs region by region (its warnings and errors name the region).
  Only this small round crosses regions. A step is committed when its record is in every region: ``committed`` is
  the intersection of the regions' committed steps, so a save that fails or crashes between two regions' records
  is committed nowhere (a failed record write also takes back the records already written); such stray records
  are deleted by the next save's clean-up, with the half-written folders, as for one store.
* **Unavailable regions.** A region whose bucket is gone or whose endpoint stays unreachable (after the
  ``RetryPolicy``) is left out of ``committed`` (with a warning) and out of loads; refused credentials are never
  "unavailable": they raise ``ObjectStoreAuthError`` naming the region and the setting to fix.
* **Load.** Each site reads every item from its own region when that region holds it (or a copy of it) and
  is available, else from the first available region (in site order) that does; rank 0 of each site logs the
  bytes its site read from other regions. A load that wants a key held only by unavailable regions (or regions the
  job has no URL for) raises ``CheckpointRegionUnavailableError`` on every rank before any shard is read, naming
  those regions.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Mapping

from multidc.hierarchical import _env
from multidc.plugins.checkpoint import retention as _retention
from multidc.plugins.checkpoint.format import COMMIT
from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreAuthError, ObjectStoreError

_log = logging.getLogger("multidc.plugins.checkpoint")
SITE = "{site}"


class CheckpointRegionUnavailableError(ObjectStoreError):
    """A load wants keys of a region-local checkpoint that only unavailable regions (or regions the job has no URL
    for) hold; raised on every rank before any shard is read, naming the regions, the number of keys and the fix."""


def from_env(url, storage_options):
    """``(url, storage_options)`` with ``None`` filled from ``MULTIDC_CKPT_URL`` (a URL, a ``{site}`` template or a
    JSON object site -> URL) and ``MULTIDC_CKPT_STORAGE_OPTIONS`` (a JSON object: options, or site -> options)."""
    if url is None:
        url = env_url()
    if storage_options is None:
        storage_options = env_storage_options()
    if url is None:
        raise ValueError(f"no checkpoint URL: pass url=... or set {_env.CKPT_URL}.")
    return url, storage_options


def env_url():
    """``MULTIDC_CKPT_URL`` (a URL, a ``{site}`` template or a JSON object site -> URL), or ``None`` if unset."""
    return _json_or_text(_env.CKPT_URL)


def env_storage_options() -> dict | None:
    """``MULTIDC_CKPT_STORAGE_OPTIONS`` (a JSON object: options, or site -> options), or ``None`` if unset."""
    raw = _env.read(_env.CKPT_STORAGE_OPTIONS)
    options = None if raw is None else _json_or_text(_env.CKPT_STORAGE_OPTIONS)
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"{_env.CKPT_STORAGE_OPTIONS} must be a JSON object (options, or site -> options).")
    return options


def _json_or_text(variable: str):
    raw = _env.read(variable)
    if raw is None or not raw.startswith("{") or raw.startswith(SITE):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        raise ValueError(f"{variable} starts with '{{' but is not a JSON object: {raw[:40]!r}...") from None


def env_replicas() -> int | None:
    """``MULTIDC_CKPT_REPLICAS`` (an int), or ``None`` if unset."""
    return _env.read_int(_env.CKPT_REPLICAS)


def replica_targets(replicas: int | None, regions: list[str] | None) -> dict[str, tuple[str, ...]]:
    """Region -> the regions that also hold its site's own state (module doc): the ``replicas`` regions after it in
    ``regions`` (site order), wrapping around; ``{}`` for none. ``replicas=None``: ``MULTIDC_CKPT_REPLICAS``, else 0.
    ``regions=None``: one store (the environment variable, a setting for the job's region-local checkpoints, is
    then ignored).

    Raises:
        ValueError: ``replicas`` is not an int >= 0, exceeds the other regions, or is passed for one store (naming
            the argument or the environment variable, and the fix).
    """
    setting = "replicas"
    if replicas is None:
        replicas, setting = env_replicas(), _env.CKPT_REPLICAS
    if replicas is None or (replicas == 0 and not isinstance(replicas, bool)) or (
            regions is None and setting == _env.CKPT_REPLICAS):
        return {}
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"{setting}={replicas!r} must be an int >= 0: the number of other regions that also hold "
                         "each site's own state (0: its own region only).")
    if regions is None:
        raise ValueError(f"{setting}={replicas} copies each site's own state to other regions, but the checkpoint URL "
                         f"names one store: give one URL per site (a template with {SITE}, or a mapping), or "
                         f"set {setting}=0.")
    if replicas > len(regions) - 1:
        raise ValueError(f"{setting}={replicas}, but there are only {len(regions) - 1} other region(s) than each "
                         f"site's (regions: {regions}): set it to at most {len(regions) - 1}, or add regions.")
    return {r: tuple(regions[(i + k) % len(regions)] for k in range(1, replicas + 1)) for i, r in enumerate(regions)}


def is_regional(url) -> bool:
    """Whether ``url`` names one store per site (a mapping, a ``{site}`` template, or a mapping as :func:`path_key`
    text)."""
    return isinstance(url, Mapping) or SITE in str(url) or str(url).startswith('{"')


def path_key(path) -> str:
    """``path`` as text: a URL / template ``/``-stripped, a mapping site -> URL as canonical JSON. The text of a
    mapping may take a suffix (Lightning joins a file name to a directory): ``{"eu": "s3://a/run"}/last.ckpt`` is
    ``s3://a/run/last.ckpt`` in region ``eu`` (:func:`url_of`)."""
    if isinstance(path, Mapping):
        return json.dumps({str(k): str(v).rstrip("/") for k, v in path.items()}, sort_keys=True)
    return str(path).rstrip("/")


def url_of(key: str):
    """The URL / template / mapping a :func:`path_key` text stands for (a mapping's suffix joined to every URL).

    Raises:
        ValueError: text that starts like a mapping (``{"``) but is not one.
    """
    if not key.startswith('{"'):
        return key
    try:
        mapping, end = json.JSONDecoder().raw_decode(key)
    except ValueError:
        raise ValueError(f"checkpoint path {key[:60]!r} starts like a mapping site -> URL but is not valid JSON: "
                         "pass the mapping itself, or a URL.") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"checkpoint path {key[:60]!r} is not a mapping site -> URL.")
    suffix = key[end:]
    return {str(site): f"{str(url).rstrip('/')}{suffix}" for site, url in mapping.items()}


def _is_site_key(key, names) -> bool:
    """Whether ``key`` names a site: an index, a digit string, or one of ``names``."""
    if isinstance(key, bool):
        return False
    return isinstance(key, int) or (isinstance(key, str) and (key.isdigit() or key in names))


def check_one_store_options(options, *, site_names=(), setting: str = "storage_options") -> None:
    """ValueError if ``options`` (for one URL) are options per site (every key a site name or index, every value a
    mapping or ``None``): one store takes one set of options. fsspec options that take a mapping (``client_kwargs``,
    a ``token`` dict, chained-URL options) pass."""
    names = {str(n) for n in site_names}
    if isinstance(options, Mapping) and options and all(_is_site_key(k, names) for k in options) and all(
            v is None or isinstance(v, Mapping) for v in options.values()):
        raise ValueError(f"{setting} gives options per site ({sorted(map(str, options))}) but the URL names one "
                         f"store: pass one URL per site (a template with {SITE}, or a mapping), or one set of "
                         "options.")


def site_urls(url, storage_options, *, site_names, setting: str = "url") -> tuple[dict[str, str], dict]:
    """``({region: URL}, {region: storage options})`` for a regional ``url``: the job's sites first (in site order),
    then any other regions a mapping names. ``storage_options`` is either one set of options for every region or a
    mapping site -> options (every key a site name or index, every value a dict or ``None``).

    Raises:
        ValueError: a site of ``site_names`` has no URL (naming the site and ``setting``), a key is neither a name
            nor an index, or the template is not a string.
    """
    names = [str(n) for n in site_names]
    if isinstance(url, Mapping):
        given = {_site_key(key, names, setting): str(value) for key, value in url.items()}
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"{setting} has no URL for site {missing[0]!r} (sites: {names}; given: "
                             f"{sorted(given)}): add {missing[0]!r}: 's3://...' to it, or use a template with "
                             f"{SITE}.")
        urls = {n: given[n] for n in names} | {n: u for n, u in given.items() if n not in names}
    else:
        urls = {n: str(url).replace(SITE, n) for n in names}
    return urls, _site_options(storage_options, names, urls)


def _site_key(key, names: list[str], setting: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ValueError(f"{setting} key {key!r} is not a site name or index.")
    if isinstance(key, str) and key.isdigit() and key not in names:  # an index that travelled as text (JSON keys)
        key = int(key)
    if isinstance(key, int):
        return names[key] if 0 <= key < len(names) else str(key)
    return key


def _site_options(options, names: list[str], urls: dict[str, str]) -> dict:
    if not options:
        return dict.fromkeys(urls)
    mappings = all(v is None or isinstance(v, Mapping) for v in options.values())
    sites = [k for k in options if (isinstance(k, int) and not isinstance(k, bool)) or k in urls]
    per_site = mappings and len(sites) == len(options)
    if mappings and sites and not per_site:  # some keys name sites, others nothing: a misspelt site
        unknown = sorted(str(k) for k in options if k not in sites)
        raise ValueError(f"storage_options gives options per site, but {unknown} name no site (sites: "
                         f"{sorted(urls)}): spell each key as a site name or index.")
    if not per_site:
        return dict.fromkeys(urls, dict(options))
    given = {_site_key(k, names, "storage_options"): v for k, v in options.items()}
    return {n: (dict(given[n]) if given.get(n) is not None else None) for n in urls}


class Regions:
    """One ``ObjectStore`` per region; ``local`` is this rank's (its site's name). Not collective.

    Args:
        urls / options: from :func:`site_urls`. ``local``: this rank's region. ``setting``: what a user changes to
            fix a region's credentials (named in errors). ``store_kwargs``: ``ObjectStore`` arguments.
    """

    def __init__(self, urls: dict[str, str], options: dict, *, local: str, setting: str = "storage_options",
                 **store_kwargs) -> None:
        if local not in urls:
            raise ValueError(f"no checkpoint URL for this rank's site {local!r} (regions: {sorted(urls)}).")
        self.stores = {name: ObjectStore(u, storage_options=options.get(name), **store_kwargs)
                       for name, u in urls.items()}
        self.local, self.setting = local, setting

    @property
    def store(self) -> ObjectStore:
        return self.stores[self.local]

    def where(self, name: str = "") -> str:
        return "; ".join(f"region {r!r}: {s.where(name)}" for r, s in self.stores.items())

    def call(self, region: str, fn, *args):
        """``fn(store of region, *args)``; an ObjectStoreError names the region and, for refused credentials, the
        setting to fix."""
        try:
            return fn(self.stores[region], *args)
        except ObjectStoreAuthError as exc:
            also = f" (or {_env.CKPT_STORAGE_OPTIONS})" if self.setting != _env.CKPT_STORAGE_OPTIONS else ""
            raise ObjectStoreAuthError(
                f"region {region!r} (site {region}): {exc} Fix this region's credentials: "
                f"{self.setting}[{region!r}]{also}.") from None
        except ObjectStoreError as exc:
            raise type(exc)(f"region {region!r} (site {region}): {exc}") from None

    def check_access(self, region: str | None = None) -> None:
        """``ObjectStore.check_access`` of ``region``, or of every region in site order: every rank sends the same
        requests, so a region refusing its credentials fails every rank with the same message."""
        for name in [region] if region is not None else list(self.stores):
            self.call(name, ObjectStore.check_access)

    def available(self) -> tuple[list[str], dict[str, str]]:
        """``(available regions, {unavailable region: why})``; refused credentials raise (see module doc)."""
        up, down = [], {}
        for region in self.stores:
            try:
                self.check_access(region)
                up.append(region)
            except ObjectStoreAuthError:
                raise
            except ObjectStoreError as exc:
                down[region] = str(exc)
        return up, down

    # ------------------------------------------------------------------ listing
    def committed(self) -> list[tuple[int, str]]:
        """``(step, name)`` committed in every available region, oldest first (module doc)."""
        found = []
        for region in self.stores:
            try:
                found.append(set(self.call(region, _retention.committed)))
            except ObjectStoreAuthError:
                raise
            except ObjectStoreError as exc:
                _log.warning("checkpoint region %r is unavailable, left out: %s", region, exc)
        if not found:
            raise ObjectStoreError(f"no checkpoint region is available ({self.where()})")
        return sorted(set.intersection(*found))

    def resolve(self, which, regions: list[str]) -> str:
        """Folder name for ``which`` (as ``retention.resolve``), committed in every region of ``regions``."""
        which = getattr(which, "name", which)
        if which == "latest":
            done = self.committed()
            if not done:
                raise FileNotFoundError(f"no committed checkpoint under {self.where()}")
            return done[-1][1]
        name = _retention.name_of(which)
        for region in regions:
            self.call(region, _retention.require_committed, name)
        return name

    # ------------------------------------------------------------------ save (rank 0)
    def claim(self, name: str, step: int, *, replace: bool) -> str | None:
        """As ``retention.claim``, over every region: the step order by ``committed``, then the folder prepared in
        each region; one shard tag for all (a fresh one when any region holds a committed ``name``)."""
        done = self.committed()
        _retention.check_order(done[-1] if done else None, step, replace=replace,
                               where=lambda n: self.where(n), name=name)
        return self.claim_folder(name)

    def claim_folder(self, name: str, *, clear_file: bool = False) -> str | None:
        """``retention.claim_folder`` in every region (after ``retention.clear_file`` with ``clear_file``), with one
        shard tag for all: a fresh one when any region holds a committed ``name``."""
        if clear_file:
            for region in self.stores:
                self.call(region, _retention.clear_file, name)
        held = [r for r in self.stores if self.call(r, ObjectStore.exists, f"{name}/{COMMIT}")]
        for region in self.stores:
            if region not in held:
                self.call(region, ObjectStore.delete_tree, name)
        return uuid.uuid4().hex[:12] if held else None

    def commit(self, name: str, record: bytes) -> None:
        """Write ``record`` as ``name``'s commit record into every region; if one fails, take back those written
        (restoring a record it replaced) and raise: the step is then committed nowhere."""
        key, written, previous = f"{name}/{COMMIT}", [], {}
        try:
            for region in self.stores:
                if self.call(region, ObjectStore.exists, key):
                    previous[region] = self.call(region, ObjectStore.get, key)
                self.call(region, functools.partial(ObjectStore.put, atomic=True), key, record)
                written.append(region)
        except BaseException:
            for region in written:
                try:
                    if region in previous:
                        self.call(region, functools.partial(ObjectStore.put, atomic=True), key, previous[region])
                    else:
                        self.call(region, ObjectStore.delete, key)
                except Exception as exc:  # the next save's clean-up deletes it (not committed everywhere)
                    _log.warning("could not take back the commit record of %s in region %r: %s", name, region, exc)
            raise

    def clean(self, name: str, files: dict[str, set[str]], *, keep_last_k: int | None, supersede: bool,
              folder_only: bool = False) -> None:
        """After ``name`` committed (region ``r``'s shards are ``files[r]``): delete stray commit records (steps
        not committed in every region), then clean each region as ``retention.clean_after_commit`` (or, with
        ``folder_only``, ``retention.remove_replaced``), through :meth:`call`: its warnings and errors name the
        region."""
        if not folder_only:
            self._drop_stray_records(name)
        for region in self.stores:
            where = self.where_in(region)
            if folder_only:
                clean = functools.partial(_retention.remove_replaced, where=where)
            else:
                clean = functools.partial(_retention.clean_after_commit, keep_last_k=keep_last_k,
                                          supersede=supersede, where=where)
            self.call(region, clean, name, files.get(region, set()))

    def where_in(self, region: str):
        """``where(key)`` for messages about ``region``'s store: the region, then the location."""
        store = self.stores[region]
        return lambda key="": f"region {region!r}: {store.where(key)}"

    def _drop_stray_records(self, name: str) -> None:
        try:
            found = {r: set(self.call(r, _retention.committed)) for r in self.stores}
        except Exception as exc:  # the save succeeded: cleaning up never fails it (the error names the region)
            _log.warning("checkpoint %s is committed, but listing the regions for stray commit records failed: %s",
                         name, exc)
            return
        everywhere = set.intersection(*found.values())
        for region, steps in found.items():
            for _, stray in sorted(steps - everywhere):
                if stray != name:
                    try:
                        self.call(region, ObjectStore.delete, f"{stray}/{COMMIT}")
                    except Exception as exc:  # as above; the next save tries again
                        _log.warning("could not delete the stray commit record %s: %s",
                                     self.where_in(region)(f"{stray}/{COMMIT}"), exc)
