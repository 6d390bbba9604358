"""Shared vocabulary of gpuslice: settings, models, events, subjects, bus, ledger, requests."""

__version__ = "0.1.0"
