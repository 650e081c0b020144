"""Kernels, each with a torch reference twin that runs anywhere."""
