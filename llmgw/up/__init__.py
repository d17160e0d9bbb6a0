"""`llmgw up`: the whole system on one machine, without root.

A control plane and gateway run in this process; a node agent runs beside it
as a process of its own and connects over mutual TLS, with certificates from
a private authority kept under the data directory. The agent installs
llama.cpp's `llama-server` (the release archive, or a build from source when
releases cannot be reached) and serves the model: the one given, the starter
model downloaded once, or the tiny test model when the download cannot be
made. Then a key is created and how to use it is printed. Ctrl-C stops
everything it started, engines included.

Its modules, by what they are for:

* ``main``: the entry point, :func:`llmgw.up.main.run`, from the first check to Ctrl-C;
* ``pki``: the private authority of this one machine and the two certificates;
* ``config``: the data directory, ports, server.yaml and agent.yaml;
* ``processes``: the agent and the mirror, processes beside `up`, and the last guard for engines;
* ``model``: the model it serves, through its mirror; ``tiny_model``: the random-weight test model;
* ``engine``: a given llama-server offered to the agent as llama.cpp's release;
* ``watch``: the control plane's progress, in words.

This module stays light (the admin client finds `up`'s data directory through
``config`` without loading the gateway).
"""

from __future__ import annotations

from llmgw.errors import LlmgwError


class UpError(LlmgwError):
    """`llmgw up` cannot go on; the message says why and what to do."""
