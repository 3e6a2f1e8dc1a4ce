"""The kernel harness: pagedkv's NVRTC kernel sources compiled unchanged as host C++ and
executed on the CPU by the libcuda stub (see README.md in this directory)."""
