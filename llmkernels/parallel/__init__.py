"""Several processes: sharded weights at the fused losses (``sharded``) and the
vocabulary-parallel cross-entropy of tensor parallelism (``vocab_parallel``, and its fused linear
form ``vocab_parallel_linear``)."""
