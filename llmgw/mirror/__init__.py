"""The model mirror: serving and fetching weights inside the network."""
