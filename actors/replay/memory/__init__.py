"""Memory: accounting, meters, allocation policies, tensor store, CUDA allocator model."""
