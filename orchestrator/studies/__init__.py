"""Many replays toward one answer: sweeps, minimum memory, the OOM study, predictions."""
