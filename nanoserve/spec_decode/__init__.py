"""Speculative decoding's parts that do not depend on the engine: proposers (n-gram lookup) and
the rejection sampler that keeps the target model's distribution."""
