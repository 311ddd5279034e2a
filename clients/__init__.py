"""Client side: the Flower ClientApp and the message format it speaks."""
