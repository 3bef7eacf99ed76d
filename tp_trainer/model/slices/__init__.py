"""One token slice through unchanged HF layers: the K/V cache over earlier slices, the slice attention, packed-example segments, deferred weight and embedding gradients, the fused head + loss."""
