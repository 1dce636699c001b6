"""Request queues, admission, chunked prefill, preemption. Imports kvcache and core, never engine."""
