"""Model loading and the Llama-family forward pass."""
