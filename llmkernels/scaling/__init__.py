"""Scaling-law experiments built on the kernels: ``llmkernels scaling`` / ``python -m llmkernels.scaling``.

A GPT/Llama-style decoder (``model``), the stdlib-sources corpus and tokenizer (``data``), training
one size (``train``), the sweep and its command line (``sweep``), the power-law fits and figure
(``fit``). ``main(argv) -> int`` runs the command line.
"""
from .sweep import main

__all__ = ["main"]
