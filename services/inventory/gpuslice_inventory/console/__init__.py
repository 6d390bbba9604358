"""The inventory's read-only web console: cluster, pod and audit views, pushed live."""
