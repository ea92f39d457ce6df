"""Compute-optimal scaling-law experiments on the kernels: ``llmkernels scaling`` /
``python -m llmkernels.scaling``.

``plan`` (shapes, budgets, the hyperparameter rule; no torch), ``data`` (corpus, split, tokens,
n-gram baselines), ``model`` (the decoder on either backend), ``train`` (one run, its step as one
CUDA graph), ``fit`` (approaches 1-3, bootstrap, extrapolation, the learning-rate rule), ``report``
(JSON, Markdown, figures), ``sweep`` (the command line) and ``runner`` (executing it).
``main(argv) -> int`` runs the command line.
"""
from .sweep import main

__all__ = ["main"]
