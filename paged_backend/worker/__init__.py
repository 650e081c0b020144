"""Running the model: batch flattening, KV cache allocation."""
