"""The node agent: discovery, engine adapters, supervision, provisioning."""
