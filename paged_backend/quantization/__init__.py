"""Weight quantization: AWQ int4 checkpoints (AutoAWQ's GEMM layout), loaded and made without autoawq."""
