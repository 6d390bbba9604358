"""The gpuslice command line."""
