"""Speculative decoding: draft proposers, the rejection sampler and their config."""
