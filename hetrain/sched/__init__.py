"""Cluster scheduling of many ring all-reduce jobs (issue #4).

`cluster` (GPU pools), `job` (job model bound to a cluster), `trace` / `patterns`
(workloads), `policies` (fifo, srtf, doubling, optimal: one call signature),
`simulator` (discrete events), `executor` (real jobs, stop/restart), `plots`, `cli`.
"""
