"""Cluster scheduling of many ring all-reduce jobs.

`cluster` (GPU pools), `job` (job model bound to a cluster), `gavel` / `trace` /
`patterns` (measured throughputs and workloads), `policies` (adaptive, doubling, fifo,
srtf, gavel, optimal: one call signature), `simulator` (discrete events), `executor`
(real jobs on this host or on Ray, stop/restart, fit-then-schedule), `plots`, `cli`.
"""
