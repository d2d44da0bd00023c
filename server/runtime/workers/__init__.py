"""The worker processes and how the driver reaches them: a worker's step, its loop, the group of spawned
workers or torchrun ranks, control messages, heartbeats, the job store, device binding and EPLB weight moves."""
