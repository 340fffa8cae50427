"""Training checkpoints: ``store`` saves and restores the run (Megatron dist-checkpointing, RNG,
prompt cursor, the run's ``Checkpointer``); ``files`` holds the on-disk rules (step directories,
manifests with checksums, resume decisions) and imports nothing heavy, so the CLI can check a
resume before torch loads."""
