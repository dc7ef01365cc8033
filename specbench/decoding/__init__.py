"""Speculative decoding itself, on token ids: sampling and verification, tree masks, cache views,
the phase clock, and the decode loops."""
