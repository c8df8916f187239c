"""Fault tests and their helpers: ranks killed mid-save, S3 outages (``seaweed``), a credentials run
(``credentials_job``), WAN cuts in the lab. The jobs the fault scripts run live in ``benchmarks/fault_jobs``."""
