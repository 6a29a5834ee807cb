"""Device staging: on the cpu "device" and on CUDA (skipped without a GPU)."""
