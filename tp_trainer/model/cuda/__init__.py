"""CUDA paths: the slice attention kernels (flash, cuDNN), captured units (CUDA graphs), compiled blocks, fused RMSNorm."""
