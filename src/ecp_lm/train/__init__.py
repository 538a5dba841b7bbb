"""Training: the loop (resumable, DDP/FSDP/context parallel), its tasks and their batches."""
