"""The CUDA backend (cuda.bindings + NVRTC). Empty until the CudaBackend lands; importing
this package must never call the driver."""
