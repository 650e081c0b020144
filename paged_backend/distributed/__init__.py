"""Tensor parallelism: which weights each rank holds (``tp_plan``)."""
