"""Native CPU kernels (C, compiled on first use) and their torch-facing wrappers."""
