"""Installing engines on a node: release archives, builds from source, environments."""
