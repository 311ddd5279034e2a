"""Deployment on real machines with Flower's deployment engine (TLS, SuperNode auth)."""
