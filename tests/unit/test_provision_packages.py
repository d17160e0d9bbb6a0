"""OS packages with the machine's own package manager, with a fake runner and clock."""

from __future__ import annotations

import pytest

from llmgw.agent.provision.host import HostFacts, parse_os_release
from llmgw.agent.provision.os_packages import PackageInstaller, install_plan, lock_held
from llmgw.agent.provision.runner import CommandResult
from llmgw.agent.provision.status import ProvisionError

APT_LISTS_LOCK = (
    "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 812 (apt-get)\n"
    "E: Unable to lock directory /var/lib/apt/lists/\n"
)
DPKG_FRONTEND = (
    "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 812 (unattended-upgr)\n"
    "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?\n"
)
NOT_ROOT = (
    "E: Could not open lock file /var/lib/dpkg/lock-frontend - open (13: Permission denied)\n"
    "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), are you root?\n"
)
ZYPPER_LOCK = (
    "System management is locked by the application with pid 2301 (zypper).\n"
    "Close this application before trying again.\n"
)
DNF_LOCK = "Waiting for process with pid 4121 to finish.\n"


class Machine:
    """Package queries and installs; ``locked`` more install commands find the lock held."""

    def __init__(self, installed=(), locked=0, lock_message=APT_LISTS_LOCK, fail_output=None):
        self.installed = set(installed)
        self.locked = locked
        self.lock_message = lock_message
        self.fail_output = fail_output
        self.calls: list[tuple[list[str], dict]] = []

    async def __call__(self, argv, *, env=None, stdin=None, timeout=None):
        argv = list(argv)
        self.calls.append((argv, dict(env or {})))
        if argv[0] == "dpkg-query":
            return (
                CommandResult(0, "ii ")
                if argv[-1] in self.installed
                else CommandResult(1, f"dpkg-query: no packages found matching {argv[-1]}")
            )
        if argv[0] == "rpm":
            return (
                CommandResult(0, argv[-1])
                if argv[-1] in self.installed
                else CommandResult(1, f"package {argv[-1]} is not installed")
            )
        if self.fail_output is not None:
            return CommandResult(100, self.fail_output)
        if self.locked > 0:
            self.locked -= 1
            return CommandResult(100, self.lock_message)
        if "install" in argv:
            i = argv.index("install")
            self.installed.update(a for a in argv[i + 1 :] if not a.startswith("-"))
        return CommandResult(0, "")

    def tool_calls(self):
        return [c for c, _ in self.calls if c[0] not in ("dpkg-query", "rpm")]


class Clock:
    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self):
        return self.now

    async def sleep(self, s):
        self.slept.append(s)
        self.now += s


def installer(machine, tools=("apt-get",), clock=None):
    clock = clock or Clock()
    return PackageInstaller(
        machine, which=lambda t: f"/usr/bin/{t}" if t in tools else None, sleep=clock.sleep, clock=clock
    ), clock


GOMP = {"deb": ["libgomp1"], "rpm": ["libgomp"]}


async def test_only_missing_packages_are_installed_with_apt():
    m = Machine(installed={"gcc"})
    pk, _ = installer(m)
    said = []
    assert await pk.ensure("deb", {"deb": ["gcc", "libgomp1"]}, said.append) == ["libgomp1"]
    assert m.tool_calls() == [
        ["apt-get", "-o=DPkg::Lock::Timeout=600", "update"],
        ["apt-get", "-o=DPkg::Lock::Timeout=600", "install", "-y", "--no-install-recommends", "libgomp1"],
    ]
    assert all(env == {"DEBIAN_FRONTEND": "noninteractive"} for c, env in m.calls if c[0] == "apt-get")
    assert said == ["installing libgomp1 with apt-get"]
    # Asked how dpkg sees it, not merely whether dpkg knows the name.
    assert ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", "libgomp1"] in [c for c, _ in m.calls]


async def test_nothing_runs_when_everything_is_there():
    m = Machine(installed={"libgomp1"})
    pk, _ = installer(m)
    assert await pk.ensure("deb", GOMP) == []
    assert m.tool_calls() == []
    # A family with nothing listed, or none known, installs nothing.
    assert await pk.ensure(None, GOMP) == []
    assert await pk.ensure("deb", {"rpm": ["x"]}) == []


@pytest.mark.parametrize("message", [APT_LISTS_LOCK, DPKG_FRONTEND])
async def test_a_package_manager_busy_with_its_own_updates_is_waited_for(message):
    m = Machine(locked=3, lock_message=message)
    pk, clock = installer(m)
    said = []
    assert await pk.ensure("deb", GOMP, said.append) == ["libgomp1"]
    assert clock.slept == [10.0, 10.0, 10.0]
    waits = [s for s in said if s.startswith("waiting for another apt-get to finish")]
    assert len(waits) == 3 and "waited 20 s of 600" in waits[-1]


async def test_a_lock_held_for_more_than_ten_minutes_fails_with_words():
    m = Machine(locked=10_000)
    pk, clock = installer(m)
    with pytest.raises(ProvisionError, match="held the package lock for more than 10 minutes"):
        await pk.ensure("deb", GOMP)
    assert 600 <= clock.now <= 610
    assert len(clock.slept) == 60


async def test_not_being_root_is_not_mistaken_for_a_lock():
    m = Machine(fail_output=NOT_ROOT)
    pk, clock = installer(m)
    with pytest.raises(ProvisionError, match="apt-get needs root to install libgomp1"):
        await pk.ensure("deb", GOMP)
    assert clock.slept == []


async def test_another_failure_is_reported_at_once():
    m = Machine(fail_output="E: Unable to locate package libgomp1\n")
    pk, clock = installer(m)
    with pytest.raises(ProvisionError, match="Unable to locate package libgomp1"):
        await pk.ensure("deb", GOMP)
    assert clock.slept == []


async def test_a_red_hat_family_node_uses_dnf_then_yum_then_zypper():
    for tools, expected in [
        (("dnf", "yum"), ["dnf", "install", "-y", "libgomp"]),
        (("yum",), ["yum", "install", "-y", "libgomp"]),
        (("zypper",), ["zypper", "--non-interactive", "install", "libgomp"]),
    ]:
        m = Machine()
        pk, _ = installer(m, tools=tools)
        assert await pk.ensure("rpm", GOMP) == ["libgomp"]
        assert m.tool_calls() == [expected]


@pytest.mark.parametrize("tool, message", [("zypper", ZYPPER_LOCK), ("dnf", DNF_LOCK)])
async def test_rpm_tools_locks_are_waited_for(tool, message):
    m = Machine(locked=1, lock_message=message)
    pk, clock = installer(m, tools=(tool,))
    said = []
    await pk.ensure("rpm", GOMP, said.append)
    assert clock.slept == [10.0]
    assert any(s.startswith(f"waiting for another {tool} to finish") for s in said)


async def test_no_package_manager_is_said_so():
    pk, _ = installer(Machine(), tools=())
    with pytest.raises(ProvisionError, match="libgomp1 is missing and no package manager"):
        await pk.ensure("deb", GOMP)


async def test_a_package_still_missing_after_install_is_an_error():
    class Liar(Machine):
        async def __call__(self, argv, **kw):
            r = await super().__call__(argv, **kw)
            self.installed.clear()  # the tool said yes and installed nothing
            return r

    pk, _ = installer(Liar(), tools=("zypper",))
    with pytest.raises(ProvisionError, match="still not installed"):
        await pk.ensure("rpm", GOMP)


async def test_a_bad_package_name_is_refused_before_anything_runs():
    m = Machine()
    pk, _ = installer(m)
    with pytest.raises(ProvisionError, match="is not a package name"):
        await pk.ensure("deb", {"deb": ["libgomp1; rm -rf /"]})
    assert m.calls == []


def test_package_manager_lock_messages_are_recognised_as_busy():
    assert lock_held(APT_LISTS_LOCK) and lock_held(DPKG_FRONTEND) and lock_held(ZYPPER_LOCK)
    assert lock_held(DNF_LOCK)
    assert not lock_held("E: Unable to locate package foo")


def test_families_from_os_release():
    for text, family in [
        ("ID=ubuntu\nID_LIKE=debian\n", "deb"),
        ("ID=debian\n", "deb"),
        ('ID=pop\nID_LIKE="ubuntu debian"\n', "deb"),
        ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "rpm"),
        ('ID="almalinux"\nID_LIKE="rhel centos fedora"\n', "rpm"),
        ('ID="opensuse-leap"\nID_LIKE="suse opensuse"\n', "rpm"),
        ("ID=arch\n", None),
    ]:
        os_id, like = parse_os_release(text)
        assert HostFacts(arch="amd64", os_id=os_id, os_like=like).family == family, text


def test_an_install_plan_uses_a_present_package_tool_or_there_is_none():
    which = {"apt-get"}.__contains__
    plan = install_plan("deb", ["a", "b"], lambda t: t if which(t) else None)
    assert plan is not None and plan.tool == "apt-get" and plan.commands[1][-2:] == ("a", "b")
    assert install_plan("rpm", ["a"], lambda t: None) is None
