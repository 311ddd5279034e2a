"""fedunlearn — federated unlearning for language models (core library, no Flower imports)."""

__version__ = "0.1.0"
