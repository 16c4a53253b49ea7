"""maskbench: compute-matched benchmarks of masked-token pretraining for text-to-image DiTs."""

__version__ = "0.1.0"
