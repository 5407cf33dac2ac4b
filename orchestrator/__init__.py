"""orch: an SSH launcher for PyTorch distributed training."""
__version__ = "0.1.0"
