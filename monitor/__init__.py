"""The training monitor: aggregate the swarm's metrics, report them, keep checkpoints."""
