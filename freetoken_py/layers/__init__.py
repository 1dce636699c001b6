"""Shared building blocks of the forward pass: norms, rotary embeddings, paged attention, MoE routing."""
