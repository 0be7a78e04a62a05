"""Speed that changes no result, attached to a plain model from outside: CPU kernels, int8 weights, the allocator."""
