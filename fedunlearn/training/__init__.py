"""Training loops: full-model (substrate building) and LoRA (client-side unlearning)."""
