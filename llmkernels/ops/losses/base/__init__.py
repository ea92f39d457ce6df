"""The base the losses stand on, bottom up: ``row_kernels`` (the row maths in Triton: online
logsumexp, soft cap, cross-entropy rows), ``targets`` (the target check), ``rows`` (cross-entropy's
row launchers, the reduction and the outputs), ``chunks`` (the row and vocabulary chunk loops over
an LM head, and the logsumexp of its rows), ``head`` (what every loss over a head shares: the
gradients needed, reductions, fakes, the two Ops of a loss with gradients formed in the forward),
``vocab_grads`` (the gradients of any row loss over vocabulary chunks), ``checks`` (argument
checks) and ``sharded`` (a DTensor head weight gathered for the call). Each loss imports from here
only."""
from .checks import (DEFAULT_MEMORY, MEMORY_MODES, REDUCTIONS, check_chunk_size, check_chunk_sizes, check_chunking,
                     check_fp32_or_none, check_head, check_ignore_index, check_loss_options, check_reduction,
                     check_target, check_temperature, checked_head)
from .chunks import Head, accumulate_mm, aligned_cols, chunk_cols, chunk_rows, logsumexp_rows, row_chunks, vocab_chunks
from .head import grads_fake, grads_needed, head_loss_ops, reduced, reduced_fake, row_grads
from .row_kernels import grad_coefs, grad_tile, lse_of, online_step, row_lse, row_online
from .rows import (CrossEntropyOutput, RowLoss, ce_rows, count_rows, finish_loss, package_output, row_buffers,
                   scale_rows_)
from .sharded import gathered, is_dtensor
from .targets import finish_target_check, start_target_check
from .vocab_grads import grad_chunk_cols, vocab_grads, vocab_loss_op

__all__ = ["DEFAULT_MEMORY", "MEMORY_MODES", "REDUCTIONS", "check_chunk_size", "check_chunk_sizes", "check_chunking",
           "check_fp32_or_none", "check_head", "check_ignore_index", "check_loss_options", "check_reduction",
           "check_target", "check_temperature", "checked_head",
           "Head", "accumulate_mm", "aligned_cols", "chunk_cols", "chunk_rows", "logsumexp_rows", "row_chunks",
           "vocab_chunks",
           "grads_fake", "grads_needed", "head_loss_ops", "reduced", "reduced_fake", "row_grads",
           "CrossEntropyOutput", "RowLoss", "ce_rows", "count_rows", "finish_loss", "package_output", "row_buffers",
           "scale_rows_", "grad_coefs", "grad_tile", "lse_of", "online_step", "row_lse", "row_online", "gathered",
           "is_dtensor", "finish_target_check", "start_target_check", "grad_chunk_cols", "vocab_grads", "vocab_loss_op"]
