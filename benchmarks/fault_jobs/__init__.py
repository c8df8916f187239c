"""What the fault scripts run: a small resumable training job (``train_job``), a per-rank launcher for the lab WAN
(``lab_job``) and the checkpoint-kill driver and worker (``ckpt_kills``). Used by ``benchmarks/fault_*.py`` and by
their short versions in ``tests/``."""
