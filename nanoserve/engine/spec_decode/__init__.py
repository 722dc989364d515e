"""Speculative decoding inside the engine: proposers (n-gram lookup, a draft model), the
verification rows and the rejection sampler that keeps the target model's distribution. Its
flag is parsed in nanoserve/speculative_config.py."""
