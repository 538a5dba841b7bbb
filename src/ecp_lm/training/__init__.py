"""Training: the loop (resumable), its tasks and their batches, and the distributed set-up
(DDP, FSDP, context parallelism)."""
