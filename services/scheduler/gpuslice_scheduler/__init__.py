"""kube-scheduler HTTP extender and the placement engine behind it."""
