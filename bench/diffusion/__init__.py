"""Diffusion benchmarks: the embedded digits model's quality (classifier accuracy, Fréchet distance)."""
