"""Sharded, striped, async, atomic checkpoints to any fsspec URL (``s3://bucket/prefix``, ``file://``, a path).

Typical use (every rank calls every function here, after ``init_process_group`` if distributed)::

    from multidc.plugins import Checkpointer, ModelState, RNGState

    ckpt = Checkpointer("s3://bucket/run1", keep_last_k=3, async_save=True)
    state = {"model": ModelState(model, optimizer), "sched": scheduler, "rng": RNGState(), "trainer": {"step": 0}}
    info = ckpt.load(state)                       # newest committed checkpoint; None-safe: see ``latest()``
    for step in ...:
        ...
        if step % 100 == 0:
            state["trainer"]["step"] = step
            ckpt.save(state, step=step)           # blocks only for the host-memory snapshot
    ckpt.close()                                  # waits for the last upload and raises its error

On storage, under the root URL::

    <root>/step_0000000100/                     one checkpoint, named by its step (10+ digits, sorts by step)
        data/rank00000.distcp                    bytes written by rank 0: its items back to back, each item
        data/rank00001.distcp                    the raw bytes of one tensor chunk, or a torch.save'd value
        ...
        COMMIT.json                              written last; its presence is what makes the folder a checkpoint

``COMMIT.json`` (plain JSON) records the format version, step, world size, creation time, every tensor's
dtype / global size / chunks (DCP metadata, so any later layout can reshard), where each chunk and value lives
(object, byte range), its CRC-32, the size of every shard object, and ``extra`` user data.

Guarantees:

* **Sharded and striped.** Each rank writes its own shard object in parallel (S3: multipart, parts sent
  concurrently). Replicated tensors (DDP, HSDP replicas) are cut into row ranges across the replicas holding
  them, so every replica uploads an equal share and exactly one copy is stored.
* **Atomic.** After every rank reported success (a collective on a dedicated gloo group: the barrier), rank
  0 writes ``COMMIT.json`` in one atomic PUT (rename on local filesystems). ``latest``, ``list_checkpoints``,
  ``load`` and retention only ever see committed checkpoints. A crash mid-save leaves the previous checkpoint
  untouched; the half-written folder is ignored and deleted by the next successful save. Nothing committed is
  deleted before the new checkpoint commits.
* **Ordered by step.** ``latest`` is the committed checkpoint with the highest step, and ``keep_last_k`` keeps the
  ``k`` highest steps. So a save must be newer than every committed checkpoint under the URL: saving a step <=
  the newest committed step raises ValueError on every rank before anything is uploaded (it would not become
  ``latest``, and retention could delete it right away). A rewound run either deletes the newer checkpoints,
  saves under another URL, or passes ``replace=True``: the save then supersedes the committed checkpoints of
  its step and later ones, which are deleted only after it committed.
* **Cleanup never fails a save.** Once ``COMMIT.json`` is written the save has succeeded; if deleting older or
  half-written checkpoints then fails, a warning on the ``multidc.plugins.checkpoint`` logger names what was
  left behind (the next save tries again).
* **Async.** ``async_save=True`` blocks only to copy this rank's share into host memory; a background thread
  checksums, uploads and commits. The next ``save``, ``load``, ``wait`` or ``close`` waits for it and raises
  its error. A sync save makes no copy: it uploads straight from the state's tensors (CPU tensors as they are;
  GPU and non-contiguous ones are copied to host first), so nothing may change them (another thread) until it
  returns.
* **Waits only for unresponsive peers.** ``timeout_s`` bounds how long a rank waits for a peer that stopped
  answering (a cut link, a hung or dead process); uploads, downloads and the commit run under a heartbeat
  between the ranks, so they may take as long as they need.
* **Verified.** Every item read on load is checked against the CRC-32 in the commit record;
  a mismatch raises ``CheckpointCorruptError`` naming the shard object, the byte range and the tensor, on
  every rank.
* **Striped loads in bounded memory.** Loads use ranged GETs, each piece copied into the restored tensors as it
  arrives; what several ranks of a site need is read once per site, an equal share per rank, and exchanged inside
  the site (``ReadConfig`` sets piece size and buffers). An async save holds this rank's share once (the
  snapshot); a sync save of CPU tensors holds no copy of it.
* **Resume anywhere.** Loading goes through DCP resharding: another world size, other dp/pp/tp sizes, other
  number of sites. Use ``ModelState`` for model + optimizer, pass LR schedulers (Stateful) directly, use
  ``RNGState`` for random streams, plain ints / dicts for counters (restored in place).
* **Safe loading.** Tensors are read as raw bytes; the commit record is JSON; other values are loaded with
  ``torch.load(weights_only=True)`` only (``trusted=True`` lifts that for stores you fully control).

Only one training job may write under a root URL at a time.
"""

from __future__ import annotations

import datetime
import functools
import threading

from multidc.hierarchical import _env
from multidc.plugins.checkpoint import regional as _regional
from multidc.plugins.checkpoint import regions as _regions
from multidc.plugins.checkpoint import retention as _retention
from multidc.plugins.checkpoint.comm import Comm, default_timeout_s
from multidc.plugins.checkpoint.format import COMMIT, CheckpointCorruptError, Commit, checkpoint_name, decode_commit
from multidc.plugins.checkpoint.handle import UNWAITED, CheckpointInfo, CheckpointSaveError, SaveHandle
from multidc.plugins.checkpoint.object_store import ObjectStore, RetryPolicy
from multidc.plugins.checkpoint.planner import SafeLoadPlanner, SafeRebuildLoadPlanner, StripedSavePlanner
from multidc.plugins.checkpoint.reader import ObjectStoreReader, ReadConfig
from multidc.plugins.checkpoint.state import RNGState, restore, state_dicts
from multidc.plugins.checkpoint.stop import PeerLeftError, check_stop
from multidc.plugins.checkpoint.storage import ObjectStoreWriter, SnapshotBuffer, stage, upload


class Checkpointer:
    """Saves and loads checkpoints under one root URL for one group of ranks.

    Constructing it is collective when a process group exists (it creates a dedicated gloo group for
    checkpoint traffic, so background uploads never interleave with training collectives): every rank of the
    default group must construct it, in the same order.

    Args:
        url: root URL (``s3://bucket/prefix``, ``file:///dir``, local path, any fsspec URL); or one per site, each
            site's region (see ``checkpoint.regions``): a mapping site name or index -> URL, or a template with
            ``{site}`` (``s3://ckpt-{site}/run1``), where every site of ``topology`` needs a URL (ValueError naming
            the site). ``None``: ``MULTIDC_CKPT_URL`` (with ``MULTIDC_CKPT_STORAGE_OPTIONS``).
        process_group: the ranks that save together (default: the default group; none: single process).
        storage_options: fsspec / s3fs options (``endpoint_url``, ``key``, ``secret``...); never logged. With one
            URL per site also a mapping site -> options (each region its endpoint and credentials).
        keep_last_k: after each commit keep only the ``k`` newest committed checkpoints (``None``: keep all).
        async_save: default for ``save(async_save=...)``. An async save copies this rank's share into a host
            buffer (the snapshot) that the Checkpointer keeps for the next async save until ``close()``.
        stripe_min_mb: replicated tensors of at least this many MiB are striped across replicas.
        part_size_mb: multipart part size for S3, MiB (>= 5). ``max_concurrency``: parallel requests per rank.
        retry: retry policy for transient storage errors.
        timeout_s: how long a rank waits for an unresponsive peer in a checkpoint collective, in seconds (default:
            the topology's ``WanConfig.timeout_s`` when ``topology`` is given, else 1800). Long work does not
            count against it: during uploads, downloads and the commit the ranks exchange a heartbeat every
            ``min(1, timeout_s / 10)`` s, so a slow upload never times out, while a cut link, a hung or a dead
            peer fails every rank within ``timeout_s`` plus one beat. ``state_dict()`` / ``load_state_dict()``
            and the copy into host memory run outside the heartbeat: the ranks must finish them within
            ``timeout_s`` of each other. After such a failure this Checkpointer refuses further use (its
            group is broken), and work abandoned on this rank writes nothing more. It also refuses further use
            (on every rank) after a load whose exchange between ranks failed, since transfers may still be
            pending on its group; restart the job.
        topology: the job's ``multidc.hierarchical.Topology``; with several sites, a checkpoint collective that
            times out or loses its connection raises ``WanError`` naming the sites and this end of the link
            (e.g. the WAN was cut during a save) instead of gloo's bare error. Loads read what a whole site needs
            once per site (striped over its ranks, exchanged inside the site).
        read_config: how loads read (``ReadConfig``: piece size, memory budgets); by default pieces of 8 MiB,
            ``max_concurrency`` GETs in flight, straight into the CPU tensors that take the stored bytes as they are
            (same dtype, contiguous), else (GPU tensors too) at most 64 MiB of GET buffers (in flight or kept for
            reuse) and one 64 MiB receive buffer per rank (a single larger GET is held alone), items of at least
            ``stripe_min_mb`` striped. A ReadConfig's ``concurrency`` / ``stripe_min_bytes`` left ``None`` take
            ``max_concurrency`` / ``stripe_min_mb``.
        replicas: with one URL per site, how many other regions also hold each site's own state (the keys only its
            region holds: a DiLoCo site model, per-rank residuals), for a load after its region is lost; those
            bytes cross the WAN at save (see ``checkpoint.regions``). ``None``: ``MULTIDC_CKPT_REPLICAS``, else 0.
            ValueError for more than the other regions, or ``replicas > 0`` with one URL (where the variable is
            ignored).
    """

    def __init__(self, url=None, *, process_group=None, storage_options: dict | None = None,
                 keep_last_k: int | None = None, async_save: bool = False, stripe_min_mb: float = 1.0,
                 part_size_mb: float = 16, max_concurrency: int = 8, retry: RetryPolicy | None = None,
                 timeout_s: float | None = None, topology=None, read_config: ReadConfig | None = None,
                 replicas: int | None = None) -> None:
        if keep_last_k is not None and (not isinstance(keep_last_k, int) or keep_last_k < 1):
            raise ValueError(f"keep_last_k={keep_last_k!r} must be a positive int or None.")
        if read_config is not None and not isinstance(read_config, ReadConfig):
            raise ValueError(f"read_config={read_config!r} must be a multidc.plugins.ReadConfig or None.")
        if stripe_min_mb < 0:
            raise ValueError(f"stripe_min_mb={stripe_min_mb} must be >= 0.")
        if timeout_s is None:
            timeout_s = default_timeout_s(topology)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds, e.g. 1800.")
        setting = "storage_options"  # what a user changes to fix a region's credentials, named in errors
        if url is None:
            if storage_options is None and _regions.env_storage_options() is not None:
                setting = _env.CKPT_STORAGE_OPTIONS
            url, storage_options = _regions.from_env(url, storage_options)
        url = _regions.url_of(url) if isinstance(url, str) else url  # a mapping as text (path_key) is a mapping
        self.regions, self._regions_down = None, {}
        if _regions.is_regional(url) and topology is None:
            raise ValueError(f"url={url!r} names one store per site, but this Checkpointer has no topology to tell "
                             f"which site each rank is in: pass topology= (e.g. Topology.build()), or one URL.")
        site_names = tuple(topology.layout.site_names) if _regions.is_regional(url) else ()
        if _regions.is_regional(url):
            urls, options = _regions.site_urls(url, storage_options, site_names=site_names)
            self.regions = _regions.Regions(urls, options, local=site_names[getattr(topology, "site", 0)],
                                            setting=setting, retry=retry, part_size_mb=part_size_mb,
                                            max_concurrency=max_concurrency)
            self.store = self.regions.store
        else:
            _regions.check_one_store_options(storage_options, site_names=site_names)
            self.store = ObjectStore(url, storage_options=storage_options, retry=retry, part_size_mb=part_size_mb,
                                     max_concurrency=max_concurrency)
        # region -> the regions that also hold its site's own state (``replicas``)
        self._copies_to = _regions.replica_targets(replicas, list(self.regions.stores) if self.regions else None)
        self.keep_last_k, self.async_save = keep_last_k, async_save
        self.stripe_min_bytes = int(stripe_min_mb * (1 << 20))
        self.comm = Comm.create(process_group, timeout=datetime.timedelta(seconds=timeout_s), topology=topology)
        # which site each rank of the group is in: a striped load exchanges pieces only inside a site
        self._sites = self.comm.all_gather(getattr(topology, "site", 0))
        self._site_names = [site_names[s] for s in self._sites] if self.regions is not None else None  # rank -> region
        # fields the caller's ReadConfig leaves None come from max_concurrency / stripe_min_mb
        self._read_config = (read_config or ReadConfig()).resolved(concurrency=max_concurrency,
                                                                   stripe_min_bytes=self.stripe_min_bytes)
        self._pending: SaveHandle | None = None
        # the async saves' host buffer, reused once the upload that read it ended (``_ready`` waits for it)
        self._snapshot = SnapshotBuffer()
        self._access_checked = False

    @property
    def timeout_s(self) -> float:
        """How long a rank waits for an unresponsive peer in a checkpoint collective, seconds."""
        return self.comm.timeout_s

    @property
    def url(self) -> str:
        return self.store.url

    # ------------------------------------------------------------------ save
    def save(self, state: dict, *, step: int, async_save: bool | None = None, extra: dict | None = None,
             replace: bool = False) -> SaveHandle:
        """Save ``state`` as checkpoint ``step``. Every rank must call this with the same ``step``.

        ``step`` must be higher than every committed checkpoint's under the URL (``latest`` and ``keep_last_k``
        go by step), unless ``replace=True``.

        Args:
            state: name -> Stateful (``ModelState``, scheduler, ``RNGState``), tensor, or nested dict/list of
                tensors and plain values.
            step: training step (int >= 0); names the checkpoint and orders ``latest``.
            async_save: override the constructor default. Async returns right after the snapshot.
            extra: small JSON-serialisable data stored in the commit record.
            replace: this save supersedes the committed checkpoints of step ``step`` and later ones (a rewound
                run; a root that holds one checkpoint, like Lightning's ``last.ckpt``). They stay loadable until
                this one committed and are deleted after; a checkpoint of the same step is replaced in place
                (new shard objects, then a new ``COMMIT.json``), so a crash mid-save leaves the old one intact.

        Raises:
            ValueError: bad ``step``; ranks passed different steps; without ``replace``, a committed checkpoint
                of this or a later step exists (on every rank, before any upload).
            ObjectStoreAuthError / ObjectStoreNotFoundError: credentials refused / bucket missing (before any
                upload, on every rank).
            CheckpointSaveError: an upload or the commit failed (sync; async: from the next call that waits).
            Any error of a ``state_dict()`` or of local planning on one rank: raised on every rank (the others
                name the failing rank), before any upload.
        """
        self._ready()
        _check_state(state)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0.")
        steps = self.comm.all_gather(step)
        if len(set(steps)) > 1:  # each rank would write into another folder and the commit would miss shards
            raise ValueError(f"ranks passed different steps to save ({dict(enumerate(steps))}); every rank must "
                             "save the same step.")
        name = checkpoint_name(step)
        if self.regions is not None:
            clean = functools.partial(self.regions.clean, keep_last_k=self.keep_last_k, supersede=replace)
            return self._write(state, name, step, lambda: self.regions.claim(name, step, replace=replace), clean,
                               extra=extra, async_save=async_save)
        clean = functools.partial(_retention.clean_after_commit, keep_last_k=self.keep_last_k, supersede=replace)
        return self._write(state, name, step, lambda: _retention.claim(self.store, name, step, replace=replace),
                           clean, extra=extra, async_save=async_save)

    def _save_folder(self, state: dict, name: str, *, step: int) -> SaveHandle:
        """``save`` into folder ``name``, any name (``ObjectStoreCheckpointIO``'s are Lightning's), replacing it in
        place; a plain file there goes first. Other folders are left alone: no step order, no retention."""
        self._ready()
        _check_state(state)
        if self.regions is not None:
            clean = functools.partial(self.regions.clean, keep_last_k=None, supersede=False, folder_only=True)
            return self._write(state, name, step, lambda: self.regions.claim_folder(name, clear_file=True), clean)

        def claim():
            _retention.clear_file(self.store, name)  # a checkpoint in another format: the folder cannot coexist
            return _retention.claim_folder(self.store, name)

        return self._write(state, name, step, claim, _retention.remove_replaced)

    def _write(self, state: dict, name: str, step: int, claim, clean, *, extra: dict | None = None,
               async_save: bool | None = None) -> SaveHandle:
        """Save into folder ``name``: ``claim()`` on rank 0 prepares it and returns its shard tag; after the commit
        rank 0 runs ``clean(store, name, files the commit references)``."""
        def prepare() -> str | None:  # every rank checks its access; rank 0 then prepares the folder
            self._check_access()
            return claim() if self.comm.rank == 0 else None

        tag = self.comm.broadcast(self.comm.raise_if_any(prepare, what=f"preparing {name}"))
        writer = ObjectStoreWriter(self.store, name, step=step, extra=extra, shard_tag=tag)
        # state_dict() and local planning can fail on one rank (a bad Stateful, an unsupported value): the planning
        # round carries that error to every rank, before any upload
        planner, plan = self.comm.plan(lambda: self._local_plan(state, writer),
                                       lambda planner, plans: self._global_plan(planner, plans, writer))
        in_background = async_save if async_save is not None else self.async_save
        staged, stage_error = None, None
        try:  # a sync save uploads straight from the state's tensors; an async one from a snapshot of them
            plan = planner.finish_plan(plan)
            staged = stage(plan, planner, _regional.file_of(plan.storage_data),
                           snapshot=self._snapshot if in_background else None)
        except Exception as exc:  # reported to every rank through the upload heartbeat, never dropped
            stage_error = exc
        handle = SaveHandle()
        args = (handle, writer, planner, staged, stage_error, name, step, clean, plan.storage_data)
        if in_background:
            self._pending = handle
            UNWAITED[handle] = self.store.where(name)
            threading.Thread(target=self._upload_and_commit, args=args, name=f"multidc-ckpt-{name}",
                             daemon=True).start()
            return handle
        self._upload_and_commit(*args)
        handle.wait()
        return handle

    def _global_plan(self, planner, plans: list, writer: ObjectStoreWriter) -> list:
        """DCP's global save plan, each rank's shard file named; under regions one per region (``checkpoint.regions``,
        its metadata kept in ``planner.region_metadata``), with the copies ``replicas`` asks for."""
        if self.regions is None:
            return writer.prepare_global_plan(planner.create_global_plan(plans)[0])
        plans = writer.prepare_global_plan(_regional.plan_by_region(planner, plans, self._site_names))
        return _regional.with_copies(plans, self._site_names, self._copies_to)

    def _ready(self) -> None:
        """Wait for the pending save; refuse further use after a failed collective."""
        self.wait()
        self.comm.check_usable()

    def _check_access(self) -> None:
        if not self._access_checked:  # once per Checkpointer: later credential failures surface from the upload
            self.regions.check_access() if self.regions is not None else self.store.check_access()
            self._access_checked = True

    def _local_plan(self, state: dict, writer: ObjectStoreWriter):
        state_dict = state_dicts(state)
        planner = StripedSavePlanner(stripe_min_bytes=self.stripe_min_bytes)
        planner.set_up_planner(state_dict, is_coordinator=self.comm.rank == 0)
        writer.set_up_storage_writer(self.comm.rank == 0)
        return planner, writer.prepare_local_plan(planner.create_local_plan())

    def _upload_and_commit(self, handle, writer, planner, staged, error, name, step, clean, shard) -> None:
        info, failure = None, None
        try:
            # every rank joins the heartbeat, also one whose staging failed: it reports that failure there
            # an upload stops (its parts cancelled) once another rank's failed: the save has failed everywhere
            send = upload if error is None else _raiser(error)
            send = _regional.sending_copies(send, shard, self.regions) if self.regions is not None else send
            results, error = self.comm.alive_outcome(send, staged, self.store, name, self.comm.until_any_fails,
                                                     what="upload")
            all_results = self.comm.gather_outcomes(results, error, what=f"saving {self.store.where(name)}",
                                                    error_type=CheckpointSaveError)
            info = self.comm.from_rank0(lambda: self._commit(writer, planner, all_results, name, step, clean),
                                        what=f"committing {self.store.where(name)}",
                                        error_type=CheckpointSaveError)
        except BaseException as exc:  # handed to the SaveHandle, raised by wait()
            failure = exc
        handle._finish(info, failure)
        if failure is None:
            UNWAITED.pop(handle, None)

    def _commit(self, writer, planner, results, name, step, clean) -> CheckpointInfo:
        check_stop(self.comm.stopped, f"committing {name}")
        if self.regions is not None:
            files = _regional.commit(self.regions, planner.region_metadata, results, self._site_names, name=name,
                                     step=step, extra=writer.extra)  # the save has succeeded once this returns
            if not self.comm.stopped.is_set():
                clean(name, files)
            return CheckpointInfo(url=f"{self.url}/{name}", name=name, step=step, world_size=self.comm.world_size)
        writer.finish(planner.metadata, results)  # the save has succeeded once this returns
        if not self.comm.stopped.is_set():  # else the collective already failed: the next save cleans up
            clean(self.store, name, {result.storage_data.file for rank_results in results for result in rank_results})
        return CheckpointInfo(url=f"{self.url}/{name}", name=name, step=step, world_size=self.comm.world_size)

    def wait(self) -> CheckpointInfo | None:
        """Wait for a pending async save; return its info or raise its error. ``None`` if none was pending.

        An error already raised by the save's own ``SaveHandle.wait()`` is not raised a second time, so a caller
        who handled a failed upload (an object-store outage) can go on loading or saving.
        """
        pending = self._pending
        if pending is None:
            return None
        pending._done.wait()
        self._pending = None  # only now: an interrupted wait leaves it pending (its upload may still read the snapshot)
        return None if pending._raised else pending.wait()

    def close(self) -> None:
        """Wait for the pending save (raising its error), release the checkpoint process group and the snapshot
        buffer."""
        try:
            self.wait()
        finally:
            self._snapshot.release()
            self.comm.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ load / list
    def load(self, state: dict, which: str | int | CheckpointInfo = "latest", *, trusted: bool = False,
             allow_partial: bool = False) -> CheckpointInfo:
        """Load a committed checkpoint into ``state`` in place (resharding to this layout). Collective.

        Args:
            state: same structure as saved (Stateful objects get ``load_state_dict``; plain values replaced).
            which: ``"latest"``, a step number, a checkpoint name (``step_0000000100``) or a CheckpointInfo.
            trusted: unpickle non-tensor values without ``weights_only`` (only for stores you control).
            allow_partial: allow keys of ``state`` missing from the checkpoint (they keep their values).

        Raises:
            FileNotFoundError: no committed checkpoint matches ``which``.
            CheckpointCorruptError: a checksum or the commit record does not match (names the shard).
        """
        self._ready()
        _check_state(state)
        name, commit = self._open(lambda: _retention.resolve(self.store, which), what=f"resolving {which!r}",
                                  which=which)
        for value in state.values():
            if isinstance(value, RNGState):
                value.select_source(commit.world_size)
        planner = SafeLoadPlanner(trusted=trusted, allow_partial_load=allow_partial)
        plain, read_error = self._read(name, commit, lambda: state_dicts(state), planner)
        self.comm.raise_if_any(_restore_unless, read_error, state, plain)
        return CheckpointInfo(url=f"{self.url}/{name}", name=name, step=commit.step,
                              world_size=commit.world_size, created_unix=commit.created_unix)

    def _load_folder(self, name: str, *, trusted: bool = False) -> dict:
        """The state saved by ``_save_folder(state, name)``, its structure rebuilt from the commit record."""
        self._ready()
        name, commit = self._open(lambda: _retention.require_committed(self.store, name), what=f"reading {name}",
                                  which=name)
        planner = SafeRebuildLoadPlanner(trusted=trusted)
        _, read_error = self._read(name, commit, dict, planner)
        if read_error is not None:  # on every rank, or on none: then there is nothing to restore
            self.comm.raise_if_any(_restore_unless, read_error, {}, {})
        return planner.original_state_dict

    def _open(self, resolve, *, what: str, which) -> tuple[str, Commit]:
        """``(folder name, commit record)`` of the checkpoint ``resolve()`` names on rank 0, on every rank. In the
        same round (as rank 0 reads the commit record) every rank checks its access to the store: a rank whose
        credentials are refused fails the load on every rank before any shard is read. Under regions: ``which``
        in every available region, and this rank's view of it (``regional.open_view``)."""
        if self.regions is not None:
            name, view, self._regions_down = _regional.open_view(self.comm, self.regions, which, what=what)
            return name, view

        def open_() -> tuple[str, bytes] | None:
            self.store.check_access()
            if self.comm.rank != 0:
                return None
            name = resolve()
            return name, self.store.get(f"{name}/{COMMIT}")

        name, raw = self.comm.broadcast(self.comm.raise_if_any(open_, what=what))
        return name, decode_commit(raw, self.store.where(f"{name}/{COMMIT}"))

    def _read(self, name: str, commit: Commit, state_dict_of, planner) -> tuple[dict, Exception | None]:
        """DCP's load of checkpoint ``name`` into the state dict ``state_dict_of()`` returns (collective), in fewer
        rounds than ``dcp.load``: the planning round also settles ``state_dict_of``'s errors, and the read's last
        errors (a value handed to the planner) are left to the caller's next error check. Returns ``(state dict,
        this rank's read error or None)``; a failed read collective raises here."""
        reader = ObjectStoreReader(self.store, name, commit, comm=self.comm, sites=self._sites,
                                   config=self._read_config,
                                   regions=self.regions.stores if self.regions is not None else None)
        coordinator = self.comm.rank == 0

        def local_step():
            state_dict = state_dict_of()
            planner.set_up_planner(state_dict, commit.metadata, coordinator)
            # a template names the keys it wants; a rebuild (no template) wants every key saved
            wanted = commit.elsewhere if isinstance(planner, SafeRebuildLoadPlanner) else planner.state_dict
            _regional.check_held(commit, wanted, name=name, down=self._regions_down)
            reader.set_up_storage_reader(commit.metadata, coordinator)
            return state_dict, reader.prepare_local_plan(planner.create_local_plan())

        state_dict, plan = self.comm.plan(
            local_step, lambda _, plans: reader.prepare_global_plan(planner.create_global_plan(plans)))
        finish_error = None
        try:
            plan = planner.finish_plan(plan)
        except Exception as exc:  # joins the read's collectives, which report it to every rank
            finish_error = exc
        if self.regions is not None:
            _regional.log_crossing(plan.storage_data, self.comm.rank, self._sites, self._site_names)
        try:
            reader.read_data(plan, planner, error=finish_error).wait()
        except Exception as exc:  # the same on every rank, but for a value handed to the planner: gathered next
            if self.comm.failure is exc:  # the group broke: no rank can gather any more
                raise
            if self.comm.failure is not None:
                raise self.comm.failure from exc
            return state_dict, exc
        if self.comm.group is not None and self.comm.peer_failed.is_set():
            # another rank failed after the read's own gather (handing a value to its planner): restore nothing here
            return state_dict, PeerLeftError("this rank read its part, but another rank's load failed")
        return state_dict, None

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first (under regions: committed in every available region). Not collective
        (any rank, any process may call it)."""
        if self.regions is not None:
            return [CheckpointInfo(url=f"{self.url}/{name}", name=name, step=step)
                    for step, name in self.regions.committed()]
        return _committed(self.store)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or ``None``. Not collective."""
        return next(reversed(self.list()), None)


def _committed(store: ObjectStore) -> list[CheckpointInfo]:
    return [CheckpointInfo(url=f"{store.url}/{name}", name=name, step=step)
            for step, name in _retention.committed(store)]


def _restore_unless(error: Exception | None, state: dict, plain: dict) -> None:
    """Raise this rank's read ``error``, else restore ``state`` from the loaded ``plain`` state dicts."""
    if error is not None:
        raise error
    restore(state, plain)


def _raiser(error: BaseException):
    """A function that raises ``error`` whatever its arguments."""
    def fail(*_args):
        raise error
    return fail


def _check_state(state) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict of name -> ModelState / Stateful / tensor / value, not "
                         f"{type(state).__name__}; e.g. {{'model': ModelState(model, optimizer)}}.")


__all__ = ["CheckpointCorruptError", "CheckpointInfo", "CheckpointSaveError", "Checkpointer", "SaveHandle"]
