"""The fleet's private certificate authority and TLS contexts."""
