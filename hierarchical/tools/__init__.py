"""Command-line tools, and the launchers that benchmarks and tests share. Never imported by a training job.

``cli`` is the ``multidc`` command: ``doctor`` (check a multi-site layout), ``lab run`` (``launch``: a command run
as several sites over a lab WAN built by ``lab``) and ``bench allreduce`` (``bench``, ranks in ``_bench_worker``).
``ranks`` runs a function on N gloo ranks in spawned processes; ``processes`` runs a launcher and kills every
process it started; ``seaweed`` starts a SeaweedFS S3 server on loopback; ``_figures`` loads matplotlib (the
``bench`` extra) for the benchmarks' PNGs and saves them.
"""
