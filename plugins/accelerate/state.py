"""``MultiDCAccelerator.save_state`` / ``load_state`` through ``multidc.plugins.Checkpointer``.

Which path a call takes (the same rule for save and load):

* a URL (anything with ``proto://``: ``s3://``, ``file://``, ``gs://`` ...) -> multidc; also one URL per site, each
  site's region (a template with ``{site}`` or a mapping site -> URL: region-local checkpoints, see
  ``multidc.plugins.checkpoint.regions``), with ``MultiDCPlugin.storage_options`` one set or site -> options;
* ``None`` with ``MULTIDC_CKPT_URL`` set (a launcher's setting; ``MULTIDC_CKPT_STORAGE_OPTIONS`` for the options
  when ``MultiDCPlugin.storage_options`` is ``None``) -> multidc, at that URL;
* a parallel layout (pipeline / tensor / FSDP shards) -> multidc, also for a local directory (Accelerate's own
  format cannot hold a model split across ranks);
* a local directory with ``MultiDCPlugin(shard_local_checkpoints=True)`` -> multidc;
* ``load_state`` of a local directory that holds committed multidc checkpoints -> multidc;
* otherwise (a local directory, or ``None`` with ``automatic_checkpoint_naming``) -> Accelerate's own.

A multidc checkpoint lives under the given root as ``<root>/step_<10 digits>/`` (the step defaults to
Accelerate's save iteration), holds model(s), optimizer(s), LR scheduler(s), the ``GradScaler``, objects from
``register_for_checkpointing``, Accelerate's step counter and every rank's RNG streams, and loads into any layout.
Private: the public face is ``multidc.plugins.MultiDCAccelerator``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from multidc.plugins.checkpoint import Checkpointer, CheckpointInfo, latest
from multidc.plugins.checkpoint.format import checkpoint_name
from multidc.plugins.checkpoint.regions import env_storage_options, env_url, is_regional
from multidc.plugins.checkpoint.state import ModelState, RNGState, StatefulDict, site_key, state_dicts


class StateMixin:
    """``save_state`` / ``load_state`` / ``wait_for_checkpoint`` for ``MultiDCAccelerator`` (mixed in before
    ``Accelerator``)."""

    def save_state(self, output_dir=None, safe_serialization: bool = True, *, step: int | None = None,
                   async_save: bool | None = None, replace: bool = False, **save_model_func_kwargs) -> str:
        """Save the training state; every rank must call it. See ``MultiDCAccelerator`` for where it goes.

        Args:
            output_dir: ``s3://bucket/prefix``, ``file:///dir``, any fsspec URL, or a local directory; one URL per
                site (``s3://ckpt-{site}/run1``, or a mapping site -> URL): each site writes to and loads from its
                own region; ``None``: ``MULTIDC_CKPT_URL`` if set, else Accelerate's automatic naming.
            safe_serialization: Accelerate's own format only.
            step: names the checkpoint (``<root>/step_<step>``) and orders ``latest``; default Accelerate's save
                iteration (``save_iteration``: 0, 1, 2, ... per ``save_state`` call). Through multidc it must be
                higher than every committed checkpoint's under the root (``ValueError`` before any upload), unless
                ``replace``.
            async_save: return right after the snapshot to host memory and upload in the background (default
                ``MultiDCPlugin.async_save``); the next save / load, ``wait_for_checkpoint`` or ``end_training``
                waits for it and raises its error.
            replace: supersede committed checkpoints of this and later steps (a run resumed from an older one):
                they are deleted after this one committed (``multidc.plugins.Checkpointer.save``).
            **save_model_func_kwargs: Accelerate's own format only.

        Elastic mode (``MultiDCPlugin(elastic=True)``): always through multidc; only one site writes
        (``ElasticSite.is_leader``; the sites of a quorum hold the same job state; under DiLoCo its model and inner
        optimizer are stored as site 0), also in a degraded quorum, so every site may call it alike; ``step``
        defaults to ``job_step``. The others return the same location without writing. The writer: after
        ``zero_grad()`` or the next training forward (the next quorum), the first of the sites that hold the job's
        latest step; between ``optimizer.step()`` and the next quorum, the first site of the step's quorum if it
        committed the step, else (it discarded the step while other sites committed it) the first of those, in
        the next quorum (``zero_grad()``), with the state taken at this call (``ElasticSite.save_once``; save
        after ``scheduler.step()``, as in any Accelerate loop). Nothing is written at step 0.

        Returns:
            Where the checkpoint is (committed when this returns on the writing site, unless async or deferred to
            the next quorum).
        """
        if not self._through_multidc(output_dir, loading=False):
            if replace:
                raise ValueError("save_state(replace=True) applies to multidc checkpoints only; this directory "
                                 "keeps Accelerate's own format (see MultiDCAccelerator).")
            return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
        _no_accelerate_kwargs(save_model_func_kwargs, "save_state")
        site = self.elastic_site if self.multidc_plugin.elastic else None
        if self.multidc_plugin.elastic and site is None:
            raise ValueError("save_state with MultiDCPlugin(elastic=True) comes after accelerator.prepare(model, "
                             "optimizer, ...): the site's quorum decides which site writes.")
        ckpt = self._checkpointer(output_dir)
        if step is None:
            step = self.job_step if site is not None else self.save_iteration
        if site is None:
            ckpt.save(self._multidc_state(step), step=step, async_save=async_save, replace=replace)
        else:  # the state as it is now (streams, counters, custom objects): the save may wait for the next quorum
            state = state_dicts(self._multidc_state(step))
            site.save_once(lambda: ckpt.save(state, step=step, async_save=async_save, replace=replace))
        self.project_configuration.iteration = step + 1
        return f"{ckpt.url}/{checkpoint_name(step)}"

    def load_state(self, input_dir=None, load_kwargs: dict | None = None, *, step: int | str | None = None,
                   trusted: bool = False, **load_model_func_kwargs):
        """Load a training state into the prepared objects, resharding to this run's layout; every rank must call
        it. Through multidc: ``step=None`` picks the newest committed checkpoint under ``input_dir``; ``trusted``
        lifts ``torch.load(weights_only=True)`` for non-tensor values (only for stores you control). Under DiLoCo
        with a top-k codec each rank resumes its own residuals (saved under its global rank); those the checkpoint
        lacks for this rank (saved without top-k, or by other ranks) restart at zero, logged.

        Elastic mode: call it right after ``prepare``, before the site's first quorum (its first ``job_step``,
        training forward or ``zero_grad``), on one site or all: the job resumes at the checkpoint's step (that
        quorum gives this site the live state if the sites present are further on, and this site's state to those
        behind or starting).

        Returns:
            A ``multidc.plugins.CheckpointInfo`` (multidc) or Accelerate's return value.

        Raises:
            FileNotFoundError: no committed checkpoint matches.
            multidc.plugins.CheckpointCorruptError: a shard fails its checksum (named).
            RuntimeError: elastic mode, after the site's first quorum (nothing loaded).
        """
        if self.multidc_plugin.elastic and self.elastic_site is None:
            raise ValueError("load_state with MultiDCPlugin(elastic=True) comes after accelerator.prepare(model, "
                             "optimizer, ...), before the site's first job_step, training forward or zero_grad.")
        if self._elastic_joined():
            raise RuntimeError("load_state with MultiDCPlugin(elastic=True) comes right after prepare, before the "
                               "first job_step, training forward or zero_grad: this site has joined the job (a site "
                               "that joins receives the live state instead). Nothing was loaded.")
        if not self._through_multidc(input_dir, loading=True):
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        _no_accelerate_kwargs({**(load_kwargs or {}), **load_model_func_kwargs}, "load_state")
        state = self._multidc_state(0)
        info: CheckpointInfo = self._checkpointer(input_dir).load(state, "latest" if step is None else step,
                                                                   trusted=trusted)
        self.step = state["accelerator"]["step"]
        self.project_configuration.iteration = info.step + 1
        if "job_step" in state["accelerator"]:  # elastic: the first quorum resumes the job at the checkpoint's step
            self.elastic_steps.sync.resume(int(state["accelerator"]["job_step"]))  # (DiLoCo: its load_state_dict)
        return info

    def _elastic_joined(self) -> bool:
        return self.elastic_steps is not None and self.elastic_steps.joined

    def wait_for_checkpoint(self) -> list[CheckpointInfo]:
        """Wait for every pending async ``save_state``; return what committed, or raise the first upload error."""
        done = [ckpt.wait() for ckpt in getattr(self, "_checkpointers", {}).values()]
        return [info for info in done if info is not None]

    def _close_checkpointers(self) -> None:
        """Wait for pending saves and free the checkpoint process groups; raise the first upload error."""
        first = None
        for ckpt in self.__dict__.pop("_checkpointers", {}).values():
            try:
                ckpt.close()
            except BaseException as exc:  # close the others, then raise it
                first = first or exc
        if first is not None:
            raise first

    def _through_multidc(self, path, *, loading: bool) -> bool:
        if path is None and env_url() is not None:  # a launcher's checkpoint URL
            return True
        if path is not None and is_regional(path):
            return True
        if self.multidc_plugin.elastic:  # one site writes the job's state: Accelerate's format has every site write
            if path is None:
                raise ValueError("with MultiDCPlugin(elastic=True) save_state / load_state need a URL or directory "
                                 "(one site writes the job's checkpoint there, through multidc).")
            return True
        if self.gradient_sync.sites_differ:  # every site's model and the DiLoCo state: only multidc's
            if path is None:
                raise ValueError(
                    "with cross_site='diloco' save_state / load_state need a URL or directory: the checkpoint holds "
                    "every site's model and the DiLoCo state, which Accelerate's own format cannot."
                )
            return True
        if path is None:
            if self.device_mesh is not None:
                raise ValueError(
                    "with a parallel layout save_state / load_state need a URL or directory (the checkpoint is "
                    "sharded across ranks; Accelerate's automatic checkpoint naming cannot hold it)."
                )
            return False
        text = os.fspath(path)
        if "://" in text or self.device_mesh is not None or self.multidc_plugin.shard_local_checkpoints:
            return True
        return loading and os.path.isdir(text) and latest(text) is not None

    def _checkpointer(self, url) -> Checkpointer:
        """One ``Checkpointer`` per root URL or set of regions (constructing one is collective: every rank gets here
        together). ``None``: ``MULTIDC_CKPT_URL`` (the Checkpointer reads it)."""
        cache = self.__dict__.setdefault("_checkpointers", {})
        if url is None:
            key = None
        elif isinstance(url, Mapping):
            url = {k: str(v).rstrip("/") for k, v in url.items()}
            key = tuple(sorted((str(k), v) for k, v in url.items()))
        else:
            url = key = os.fspath(url).rstrip("/")
        if key not in cache:
            plugin = self.multidc_plugin
            keep = plugin.keep_last_k if plugin.keep_last_k is not None else self.project_configuration.total_limit
            options = plugin.storage_options if plugin.storage_options is not None else env_storage_options()
            cache[key] = Checkpointer(url, storage_options=options, keep_last_k=keep,
                                      replicas=plugin.checkpoint_replicas, async_save=plugin.async_save,
                                      topology=getattr(self, "topology", None))
        return cache[key]

    def _multidc_state(self, step: int) -> dict:
        """Everything ``save_state`` stores, as Stateful objects / plain values that ``load`` restores in place."""
        optimizers = [getattr(o, "optimizer", o) for o in self._optimizers]
        models = {f"model{index}": ModelState(model, owned)
                  for index, (model, owned) in enumerate(_pair_optimizers(self._models, optimizers))}
        sync = self.gradient_sync
        sites = sync.checkpoint_sites()  # DiLoCo: each site's model differs between syncs
        state: dict = {site_key(sites["site"]): StatefulDict(models)} if sites else dict(models)
        if sites.get("diloco") is not None:  # the outer state, the same on every site (per shard of a layout), and
            # with a top-k codec each rank's own residuals, under its global rank
            state["diloco"] = sites["diloco"]
        for index, scheduler in enumerate(self._schedulers):
            state[f"scheduler{index}"] = getattr(scheduler, "scheduler", scheduler)
        for index, obj in enumerate(self._custom_objects):
            state[f"custom{index}"] = obj
        if self.scaler is not None:
            state["scaler"] = self.scaler
        state["rng"] = RNGState()
        state["accelerator"] = {"step": self.step, "iteration": step}
        if sync.quorum_per_step:  # per-step elastic: the job's committed steps (read without joining), where the
            state["accelerator"]["job_step"] = sync.job_step  # job resumes (elastic DiLoCo: in its own state)
        return state


def _pair_optimizers(models: list, optimizers: list) -> list[tuple]:
    """``[(model, [its optimizers])]``: each optimizer goes with the one model that owns all its parameters."""
    owners = [{id(p) for p in model.parameters()} for model in models]
    pairs = [(model, []) for model in models]
    for optimizer in optimizers:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        found = [i for i, owned in enumerate(owners) if params <= owned]
        if len(found) != 1:
            raise ValueError(
                f"an optimizer's parameters belong to {len(found)} of the {len(models)} prepared models; "
                f"save_state through multidc stores each optimizer with the one model that owns its parameters."
            )
        pairs[found[0]][1].append(optimizer)
    return pairs


def _no_accelerate_kwargs(kwargs: dict, what: str) -> None:
    if kwargs:
        raise ValueError(
            f"{what}({', '.join(sorted(kwargs))}=...) are options of Accelerate's own checkpoint format; multidc's "
            f"sharded checkpoints take step=, async_save= (save) / step=, trusted= (load)."
        )

