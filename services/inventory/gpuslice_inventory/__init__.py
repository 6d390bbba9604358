"""Keeps the ledger true over time: inventories, telemetry, releases, reconciliation."""
