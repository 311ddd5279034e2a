"""What people run: local simulations, sweeps, benchmarks and plots."""
