"""The machines the onboarding tests run on (tests/e2e/machines.py): booted, reachable, gone after."""

import os
import subprocess
from pathlib import Path

import pytest
from machines import Machines


def _nspawn_pids(root: Path) -> list[int]:
    """Processes still running systemd-nspawn on this root."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"systemd-nspawn") and f"--directory={root}".encode() in cmd:
                pids.append(int(d.name))
    return pids


@pytest.mark.slow
def test_two_machines_boot_systemd_reach_each_other_take_ssh_and_leave_nothing_behind(machine_root, tmp_path):
    with Machines(machine_root, tmp_path / "machines") as machines:
        bridge = machines.bridge
        a, b = machines.boot("alpha", "beta")
        assert a.address != b.address

        for m in (a, b):
            # systemd is PID 1 and has finished booting (degraded: some unit a container cannot run failed).
            assert machines.ssh(m.name, "cat /proc/1/comm").stdout.strip() == "systemd"
            state = machines.ssh(m.name, "systemctl is-system-running --wait", check=False).stdout.strip()
            assert state in ("running", "degraded"), machines.ssh(m.name, "systemctl --failed", check=False).stdout
            assert machines.ssh(m.name, "hostname").stdout.strip() == m.name
            assert machines.ssh(m.name, "ip -4 -o addr show host0").stdout.split()[3] == f"{m.address}/24"

        ids = {machines.ssh(m.name, "cat /etc/machine-id").stdout.strip() for m in (a, b)}
        assert len(ids) == 2, f"the machines share a machine id: {ids}"

        # Over the bridge, machine to machine: each reads the other's SSH banner.
        for here, there in ((a, b), (b, a)):
            banner = machines.ssh(
                here.name,
                f"python3 -c \"import socket; print(socket.create_connection(('{there.address}', 22), 5).recv(64))\"",
            ).stdout
            assert "SSH-2.0-OpenSSH" in banner

        # Files go in; a write lands in that machine's overlay only, never in the shared root.
        payload = tmp_path / "payload.txt"
        payload.write_text("from the host\n")
        machines.copy_in("alpha", payload, "/root/payload.txt")
        assert machines.ssh("alpha", "cat /root/payload.txt").stdout == "from the host\n"
        assert machines.ssh("beta", "test -e /root/payload.txt", check=False).exit_status == 1
        assert not (machine_root / "root" / "payload.txt").exists()

        # One machine's host key can change (for the refusal test) without touching the other's.
        shared = machines.host_key("beta")
        assert machines.host_key("alpha") == shared
        changed = machines.change_host_key("alpha")
        assert changed != shared
        assert machines.host_key("alpha") == changed
        assert machines.host_key("beta") == shared
        assert machines.ssh("alpha", "true").exit_status == 0

        # SIGTERM is a clean poweroff: nspawn exits 0 once the machine's systemd has shut down.
        assert machines.poweroff("alpha") == 0
        assert not a.alive() and b.alive()
        assert machines.poweroff("beta") == 0
        assert not _nspawn_pids(machine_root)
        for m in (a, b):
            assert not any(c.exists() for c in m.cgroups), m.cgroups

    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
    assert not {"vb-alpha", "vb-beta"} & set(os.listdir("/sys/class/net"))


@pytest.mark.slow
def test_leaving_the_block_powers_off_every_machine_even_when_the_test_fails(machine_root, tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"), Machines(machine_root, tmp_path / "m") as machines:
        bridge = machines.bridge
        (m,) = machines.boot("gamma")
        raise RuntimeError("the test failed")
    assert not m.alive()
    assert not _nspawn_pids(machine_root)
    assert not any(c.exists() for c in m.cgroups)
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
