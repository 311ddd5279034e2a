"""Models and tokenizers: the built-in tiny Llama substrate and local Hugging Face checkpoints."""
