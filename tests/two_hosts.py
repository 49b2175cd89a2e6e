"""Two "hosts" on one machine for tests: network namespaces TAGa and TAGb joined by a veth pair
(TAGx in a, TAGy in b) with addresses A and B. More than two: create_switched() puts hosts
TAGh0, TAGh1, ... on a bridge in namespace TAGsw, each through a veth pair of its own. Either is
removed, with whatever runs in its namespaces, by remove()."""
import os
import shutil
import subprocess


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _place(ns, ifname, addr):
    """Moves interface ifname into namespace ns with addr/24, and brings it and lo up."""
    _ip("link", "set", ifname, "netns", ns)
    _ip("-n", ns, "addr", "add", addr + "/24", "dev", ifname)
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("-n", ns, "link", "set", ifname, "up")


def create(tag, a, b, hosts_entry=None):
    """Returns ((namespace, interface) of host a, (namespace, interface) of host b). hosts_entry:
    an /etc/hosts line both namespaces see (through `ip netns exec`'s /etc/netns/NAME/hosts)."""
    _ip("netns", "add", tag + "a")
    _ip("netns", "add", tag + "b")
    _ip("link", "add", tag + "x", "type", "veth", "peer", "name", tag + "y")
    hosts = ((tag + "a", tag + "x", a), (tag + "b", tag + "y", b))
    for ns, ifname, addr in hosts:
        _place(ns, ifname, addr)
        if hosts_entry:
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + hosts_entry + "\n")
    return (hosts[0][0], hosts[0][1]), (hosts[1][0], hosts[1][1])


def create_switched(tag, addrs):
    """One namespace per address (TAGh0, TAGh1, ...), each with interface TAGe<i> on a /24, all
    joined by a bridge in namespace TAGsw, as hosts on one switch. Shaping each host's interface
    (tc on its egress) gives every host a link of that rate, full duplex. Returns [(namespace,
    interface)] in the order of addrs."""
    switch = tag + "sw"
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    hosts = []
    for i, addr in enumerate(addrs):
        ns, ifname, port = f"{tag}h{i}", f"{tag}e{i}", f"{tag}p{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", ifname, "type", "veth", "peer", "name", port)
        _ip("link", "set", port, "netns", switch)
        _ip("-n", switch, "link", "set", port, "master", "br0")
        _ip("-n", switch, "link", "set", port, "up")
        _place(ns, ifname, addr)
        hosts.append((ns, ifname))
    return hosts


def _namespaces(tag):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    made = {tag + "a", tag + "b", tag + "sw"}
    return [n for n in names if n in made or (n.startswith(tag + "h") and n[len(tag) + 1:].isdigit())]


def remove(tag):
    """Kills what runs in the namespaces and deletes them; True when none is left."""
    for ns in sorted(set(_namespaces(tag)) | {tag + "a", tag + "b"}):
        subprocess.run(f"ip netns pids {ns} 2>/dev/null | xargs -r kill -9", shell=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    try:
        os.rmdir("/etc/netns")  # only when empty: this test made it
    except OSError:
        pass
    return not _namespaces(tag)
