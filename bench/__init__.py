"""Benchmarks of OpenForge's hot paths; run each as ``python -m bench.<name>``."""
