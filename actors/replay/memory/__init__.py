"""Memory: accounting, measuring meters, allocation policies, the tensor store, the CUDA allocator model."""
