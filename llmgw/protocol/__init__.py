"""Messages between the node agent and the control plane (pydantic), shared by both sides."""
