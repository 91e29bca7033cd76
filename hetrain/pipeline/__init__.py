"""HeterPS runtime: run a placement plan as a pipeline of CPU and dense stages with a
sharded sparse parameter server (issue #6). See docs/heterps-runtime.md."""
