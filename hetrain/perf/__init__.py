"""One numpy-only performance model shared by the planner, the scheduler and the simulator.

Modules: `comm` (BytePS split, ring and PS transfer times), `steptime` (a data-parallel
worker's step time vs its share and the min-max share solver), plus the placement
(`pipeline`) and job-scaling (`jobs`) models that build on it.
"""
