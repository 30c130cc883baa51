"""Pooling: embeddings from the decoder's final hidden states (vLLM's pooling runner).

`params.py` (`PoolingParams`, light: the core imports it), `config.py` (`PoolerConfig`:
the checkpoint's sentence-transformers files and `--pooler-config`; which runner an
engine is). The tensors are the runner's (worker/pooler.py, worker/runner_pooling.py).
"""
