"""Model names to files, weight loading (GGUF and HF safetensors), tokenizer and chat template."""
