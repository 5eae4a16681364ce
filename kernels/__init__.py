"""CUDA C++ kernels of zerodram and the run-time compiler that builds them.

Sources live in `kernels/cuda/` (`*.cu` kernels, `*.cuh` shared device code). `zerodram.kernels.jit`
compiles them with NVRTC through cuda.core for one arch (sm_90 by default) into cubins cached on
disk, and launches them on PyTorch's current stream. Compiling needs no GPU; loading and
launching do.
"""
