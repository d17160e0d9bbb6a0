"""doctor's control-plane check against a real TLS listener made with llmgw.pki:
mutual TLS as the agent port speaks it, an aiohttp-like answer with a Date header."""

from __future__ import annotations

import asyncio
import threading
import time
from email.utils import formatdate

import pytest

from llmgw.doctor import evaluate
from llmgw.doctor.facts import ControlPlaneTarget, dial_control_plane
from llmgw.pki.ca import init_ca, issue_client, issue_server
from llmgw.pki.tls import server_context
from llmgw.protocol.doctor import Facts, Level
from llmgw.testing.waiting import until


class Listener:
    """An asyncio TLS server in its own thread answering every request with a 404 and a Date
    header skewed by ``skew`` seconds (the agent port answers /health that way)."""

    def __init__(self, ctx, skew: float = 0.0):
        self.ctx, self.skew, self.port = ctx, skew, None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _handle(self, reader, writer):
        try:
            await reader.readuntil(b"\r\n\r\n")
            date = formatdate(time.time() + self.skew, usegmt=True)
            writer.write(f"HTTP/1.1 404 Not Found\r\nDate: {date}\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _start(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        until(lambda: self.port, what="the TLS listener to start")
        return self

    def __exit__(self, *exc):
        async def stop():
            self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def pki(tmp_path):
    init_ca(tmp_path / "ca")
    issue_client(tmp_path / "ca", tmp_path / "node", "node-a", admin_names={"admin"})
    return tmp_path


def server_for(pki, names, ca="ca"):
    issue_server(pki / ca, pki / f"srv-{names[0]}", names)
    d = pki / f"srv-{names[0]}"
    return server_context(pki / ca / "ca.pem", d / "server.pem", d / "server-key.pem")


def target(pki, port):
    return ControlPlaneTarget(
        f"127.0.0.1:{port}",
        "127.0.0.1",
        port,
        ca=str(pki / "ca" / "ca.pem"),
        cert=str(pki / "node" / "node-a.pem"),
        key=str(pki / "node" / "node-a-key.pem"),
    )


def test_a_control_plane_whose_certificate_verifies_and_names_the_address_is_ok_with_its_clock(pki):
    with Listener(server_for(pki, ["127.0.0.1", "cp.example"])) as srv:
        cp = dial_control_plane(target(pki, srv.port))
    assert cp.reachable and cp.certificate_ok and cp.client_certificate
    assert "127.0.0.1" in (cp.certificate_names or [])
    assert cp.clock_offset_s is not None and abs(cp.clock_offset_s) < 3
    findings = evaluate(Facts(control_plane=cp))
    assert [f.level for f in findings] == [Level.OK, Level.OK]
    assert "its certificate verifies and names 127.0.0.1" in findings[0].message


def test_a_skewed_control_plane_clock_is_read_from_its_date_header(pki):
    with Listener(server_for(pki, ["127.0.0.1"]), skew=600) as srv:
        cp = dial_control_plane(target(pki, srv.port))
    assert cp.clock_offset_s is not None and 597 < cp.clock_offset_s < 603
    assert any(f.level is Level.FAIL and "not yet valid" in f.message for f in evaluate(Facts(control_plane=cp)))


def test_a_certificate_not_naming_the_address_dialled_fails_with_the_server_init_fix(pki):
    with Listener(server_for(pki, ["cp.example"])) as srv:
        cp = dial_control_plane(target(pki, srv.port))
    assert cp.certificate_ok is False and cp.certificate_problem == "name"
    assert cp.certificate_names == ["cp.example"]
    f = evaluate(Facts(control_plane=cp))[0]
    assert f.level is Level.FAIL and "does not name 127.0.0.1" in f.message and "(it names cp.example)" in f.message
    assert f.fix == "on the control plane: llmgw server init --host 127.0.0.1 (reissues it with that name added)"


def test_a_certificate_from_another_authority_fails_saying_so(pki):
    init_ca(pki / "other")
    # The listener trusts our CA for clients but presents a certificate from another authority.
    issue_server(pki / "other", pki / "srv-other", ["127.0.0.1"])
    ctx = server_context(pki / "ca" / "ca.pem", pki / "srv-other" / "server.pem", pki / "srv-other" / "server-key.pem")
    with Listener(ctx) as srv:
        cp = dial_control_plane(target(pki, srv.port))
    assert cp.certificate_ok is False and cp.certificate_problem == "authority"
    f = evaluate(Facts(control_plane=cp))[0]
    assert f.level is Level.FAIL and "is not from the authority in" in f.message and "ca.pem" in (f.fix or "")


def test_without_a_readable_node_certificate_the_server_certificate_is_still_checked(pki):
    with Listener(server_for(pki, ["127.0.0.1"])) as srv:
        t = target(pki, srv.port)
        cp = dial_control_plane(
            ControlPlaneTarget(t.address, t.host, t.port, ca=t.ca, cert=str(pki / "none.pem"), key=None)
        )
    assert cp.certificate_ok is True and cp.client_certificate is False
    assert cp.clock_offset_s is None and "presented none" in (cp.clock_error or "")
    assert any(f.level is Level.WARN and "clock" in f.message for f in evaluate(Facts(control_plane=cp)))


def test_nothing_listening_is_unreachable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cp = dial_control_plane(ControlPlaneTarget(f"127.0.0.1:{port}", "127.0.0.1", port, ca="/nonexistent"))
    assert cp.reachable is False and cp.connect_error


def test_a_node_certificate_without_the_node_mark_warns_and_an_administrators_fails_with_the_node_add_fix(pki):
    from llmgw.pki import issue_admin
    from llmgw.testing.pki import issue_unmarked

    with Listener(server_for(pki, ["127.0.0.1"])) as srv:
        marked = dial_control_plane(target(pki, srv.port))
        issue_unmarked(pki / "ca", pki / "node", "node-a")
        unmarked = dial_control_plane(target(pki, srv.port))
        (pki / "node" / "node-a.pem").unlink()
        issue_admin(pki / "ca", pki / "node", "node-a")
        admin = dial_control_plane(target(pki, srv.port))
    assert marked.client_certificate_kind == "node"
    assert [f.level for f in evaluate(Facts(control_plane=marked))] == [Level.OK, Level.OK]
    assert unmarked.client_certificate_kind == "unmarked"
    (warn,) = [f for f in evaluate(Facts(control_plane=unmarked)) if f.level is Level.WARN]
    assert "no node mark" in warn.message and "require_node_mark" in warn.message and "node add" in (warn.fix or "")
    (fail,) = [f for f in evaluate(Facts(control_plane=admin)) if f.level is Level.FAIL]
    assert "is an administrator's" in fail.message and "node add" in (fail.fix or "")
