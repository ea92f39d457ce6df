"""The base the losses stand on, bottom up: ``row_kernels`` (cross-entropy rows with an online
logsumexp, the softcap), ``targets`` (the target check), ``rows`` (their launchers, the reduction
and the outputs), ``chunks`` (an LM head's logits in row or vocabulary chunks, and the gradients
over vocabulary chunks), ``checks`` (the argument checks) and ``head`` (the registration of a loss
over an LM head), ``sharded`` (a DTensor head weight gathered for the call). Each loss imports from
here only."""
from .checks import (DEFAULT_MEMORY, MEMORY_MODES, REDUCTIONS, check_chunk_size, check_chunking, check_head,
                     check_ignore_index, check_loss_options, check_reduction, check_target, check_temperature)
from .chunks import accumulate_mm, aligned_cols, chunk_rows, grads_by_vocab_chunks, head_logits
from .head import grads_fake, head_loss_ops
from .row_kernels import grad_coefs, grad_tile, online_step, row_lse
from .rows import (CrossEntropyOutput, RowLoss, ce_rows, count_rows, finish_loss, package_output, row_buffers,
                   scale_rows_)
from .sharded import gathered, is_dtensor
from .targets import finish_target_check, start_target_check

__all__ = ["DEFAULT_MEMORY", "MEMORY_MODES", "REDUCTIONS", "check_chunk_size", "check_chunking", "check_head",
           "check_ignore_index", "check_loss_options", "check_reduction", "check_target", "check_temperature",
           "accumulate_mm", "aligned_cols", "chunk_rows", "grads_by_vocab_chunks", "head_logits", "grads_fake",
           "head_loss_ops",
           "CrossEntropyOutput", "RowLoss", "ce_rows", "count_rows", "finish_loss", "package_output", "row_buffers",
           "scale_rows_", "grad_coefs", "grad_tile", "online_step", "row_lse", "gathered", "is_dtensor",
           "finish_target_check", "start_target_check"]
