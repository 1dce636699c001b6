"""Model + KV cache + sampler: `ModelRunner.forward_batch(batch)`; owns no queues."""
