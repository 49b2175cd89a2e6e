"""A free TCP port for a test's rendezvous, from below the kernel's ephemeral range.

A port the kernel hands out for bind(0) comes from the ephemeral range, from which it also picks
the local port of every outgoing connection: between the test picking it and the job's store
binding it, a connection of the job itself can take it ("Address already in use"). Ports below
that range are never handed out implicitly."""
import random
import socket


def free_port():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")
