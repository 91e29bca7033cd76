"""HeterPS runtime: run a placement plan as a pipeline of CPU and dense stages with a
sharded sparse parameter server. See docs/heterps-runtime.md."""
