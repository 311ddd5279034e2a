"""Server side: Flower strategies around the fedunlearn merges, and the ServerApp."""
