"""Several processes: the vocabulary-parallel cross-entropy of tensor parallelism
(``vocab_parallel``, and its fused linear form ``vocab_parallel_linear``). Sharded (DTensor) head
weights at the fused losses are gathered by the losses themselves (``ops.losses.base.sharded``)."""
