"""The GPU side: blocks held on a CUDA device and decoded there (``device_decode``), the torch
encoder that writes the codec's bytes on the device (``device_encode``), and the Triton kernels
that fuse decoding, encoding and attention (``fused_*``, the longest with their kernels in
``*_kernels``, on ``triton_support``). Everything here imports torch; nothing in the CPU path
imports this package unless a tensor is on a GPU."""
