"""The worker: lease loop, heartbeats, checkpoints, engine adapters."""
