"""The CUDA C++ kernels (csrc/): the library (lib) and the launch configs (fp8, experts)."""
