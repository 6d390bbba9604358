"""Mutating admission webhook: validates, defaults and routes GPU pods."""
