"""The losses over a vocabulary, as siblings on one base (``base/``: row maths and vocabulary
chunks, argument checks, the target check, the registration of a loss over an LM head):
``cross_entropy`` over logits, and over an LM head without its logits ``linear_cross_entropy``,
``log_probs`` and ``distill``. Each imports from the base only, never from a sibling. (The
public functions are the siblings' own names: ``llmkernels`` exports them.)"""
