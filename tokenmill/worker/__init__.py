"""Runner-side state: the persistent batch, KV tensors, the model runner."""
