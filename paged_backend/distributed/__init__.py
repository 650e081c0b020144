"""Tensor parallelism across processes: the ranks' workers and the all-reduce between them. Which weights each
rank holds is ``model_loader/tp_plan.py``."""
