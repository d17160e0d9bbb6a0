"""The base every wire model shares.

Two rules hold for every model in this package, because agents and control
planes of different releases talk to each other during an upgrade:

* unknown fields are ignored: a newer peer adds fields, an older one must
  still read the rest of the message;
* an optional field defaults to ``None``, meaning "unknown" or "not said",
  never to a made-up value such as 0 or "": a zero read as "the node has no
  memory" or "the card is idle" is worse than no figure at all.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A value that travels between the agent and the control plane."""

    # Lax when built in Python (enums from strings, nested models from dicts);
    # decoding from the wire is strict (see codec.decode).
    model_config = ConfigDict(extra="ignore", use_enum_values=False)
