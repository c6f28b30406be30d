"""``pyparallel bench``: every strategy side by side on this machine, measured against the planner's
prediction and PyTorch's own implementations (docs/bench.md). ``cli.main(argv)`` is the entry point."""
