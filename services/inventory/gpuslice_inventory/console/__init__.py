"""The inventory's read-only web console: cluster, pods and audit, pushed live."""
