"""The control plane: catalog, placement, reconciler, agent service."""
