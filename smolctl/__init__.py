"""smolctl: composable command-line utilities for training small language models."""

__version__ = "0.1.0"
