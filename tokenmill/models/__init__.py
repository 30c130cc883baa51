"""Model implementations in plain PyTorch, and the loader that fills them from HF checkpoints."""
