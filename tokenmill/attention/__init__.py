"""Attention backends: one module per set of kernels, each a metadata builder and an
implementation, chosen by the platform per KV cache spec.

    metadata.py    AttentionMetadata / PrefillChunk / StateMetadata: a step's inputs
    builder.py     AttentionMetadataBuilder: metadata from block tables (the base)
    backend.py     AttentionBackend (supports / make_builder / make_impl),
                   AttentionImpl (paged K/V), MLAImpl (latent rows)
    torch_ref.py   "torch": gather + SDPA, every device (the reference)
    cpu_native.py  "cpu_native": kv_cache_write + paged_decode + paged_prefill kernels
    triton.py      "triton": write_kv / paged_decode / paged_prefill (CUDA), its builder
                   adding the flat slot_mapping and prefill fields; triton imported lazily
    mla.py         "mla_torch" / "mla_cpu_native": the absorbed decode's latent attention

`Platform.attention_backend(spec)` picks one per KV cache group; the runner makes the
group's builder and binds each layer's `impl` from it in `initialize_kv_cache`, so a
forward pass never asks which kernels exist.
"""
