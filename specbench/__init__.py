"""specbench: run and benchmark speculative decoding."""

__version__ = "0.1.0"
