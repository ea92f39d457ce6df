"""Compute-optimal scaling-law experiments on the kernels: ``llmkernels scaling`` /
``python -m llmkernels.scaling``.

``plan`` (shapes, budgets, the batch and learning-rate rules, the GPU-time model; no torch),
``design`` (which runs each stage trains), ``data`` (corpus, split, tokens, n-gram baselines),
``model`` (the decoder on either backend), ``train`` (one run, its step as one CUDA graph),
``workers`` (the training processes, one per GPU), ``envelope`` (approach 1, the curves'
frontier), ``fit`` (approach 2, the learning-rate rule), ``surface`` (approach 3 and E's
profile), ``intervals`` (the estimator of every quoted number, its bootstrap, the extrapolation),
``gate`` (the quality gate), ``literature`` (the published fits as records), ``report``,
``markdown`` and ``figures`` (JSON, Markdown, figures), ``compare`` (two sweeps side by side),
``synthetic`` (sweeps of known exponents for the tests and the design study), ``store`` (the
output folder's JSON files and archive), ``runner`` (executing a sweep) and ``sweep`` (the command
line; imports run downward from it).
``main(argv) -> int`` runs the command line.
"""
from .sweep import main

__all__ = ["main"]
