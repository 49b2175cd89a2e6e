#!/usr/bin/env python3
"""Hosts on one switch whose links have a rate AND a delay, for kernels without sch_netem (this
one: tc has tbf but no netem, fq or etf). Each host is a network namespace whose interface is a
tap device; this process holds every tap and is the switch: it learns MAC addresses, and sends
each frame a host transmits through that host's uplink, modelled as a link of `rate` bytes/s with
`delay` one way and a drop-tail queue (what netem delay + tbf give): a frame leaves the queue
len/rate after the previous one, and arrives `delay` later. Between two hosts the round trip is
2 x delay. The taps take TSO/GSO frames (virtio-net headers), so TCP keeps its 1448-byte segments
and congestion window while the switch handles ~64 KB at a time; a frame's wire size counts the
headers of every segment it stands for.

  python3 tests/shaped_switch.py TAG ADDR [ADDR...] [--rate-mbit 100] [--delay-ms 25] [--queue-ms 200]

makes namespaces TAGh0, TAGh1, ... (interface TAGe<i>, ADDR/24), prints "ready", and forwards until
stdin closes or it is killed. Commands on stdin, one per line: "shape MBIT DELAY_MS" sets every
uplink (MBIT 0: no rate limit), "blackhole I" drops every frame to and from host I (a silent
host: no RST, no FIN, as `netem loss 100%`), "restore I" ends that, "stats" prints frames/bytes
forwarded and dropped. Namespaces are left for the caller to delete (two_hosts.remove(TAG)); the
taps go with this process. Needs root. From Python: Switch (below) starts one and sends these.
Rates count Ethernet's bytes on the wire (frame, preamble, gap): 1448-byte TCP segments carry at
most 0.941 of the rate as payload.
"""
import argparse
import ctypes
import fcntl
import heapq
import os
import select
import struct
import subprocess
import sys
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF, TUNSETOFFLOAD, TUNSETVNETHDRSZ = 0x400454CA, 0x400454D0, 0x400454D8
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR = 12  # struct virtio_net_hdr_mrg_rxbuf: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers
ETH_OVERHEAD = 24  # preamble 8 + FCS 4 + inter-frame gap 12: on the wire besides the frame itself


def _setns(fd):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def open_tap(namespace, name):
    """A tap device `name` created inside `namespace` (this process returns to its own)."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VNET_HDR))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
        return fd
    finally:
        _setns(home)
        os.close(home)
        os.close(target)


def wire_bytes(frame):
    """Bytes the frame stands for on an Ethernet wire: one frame per TCP segment of a GSO frame."""
    _, gso_type, hdr_len, gso_size = struct.unpack_from("<BBHH", frame, 0)
    payload = len(frame) - VNET_HDR
    if gso_type == 0 or gso_size == 0:
        return payload + ETH_OVERHEAD
    segments = max(1, -(-(payload - hdr_len) // gso_size))
    return payload + (segments - 1) * hdr_len + segments * ETH_OVERHEAD


class Uplink:
    """A host's link to the switch: serialization at `rate`, then `delay`; drop-tail queue."""

    def __init__(self, rate, delay, queue_s):
        self.rate, self.delay, self.queue_s = rate, delay, queue_s
        self.free_at = 0.0

    def arrival(self, now, size):
        """When a frame of `size` wire bytes sent at `now` reaches the switch's far side, or None
        when the queue (queue_s of backlog at rate) is full. Rate 0: no limit."""
        if not self.rate:
            return now + self.delay
        start = max(now, self.free_at)
        if start - now > self.queue_s:
            return None
        self.free_at = start + size / self.rate
        return self.free_at + self.delay


def serve(taps, rate, delay, queue_s, control):
    uplinks = [Uplink(rate, delay, queue_s) for _ in taps]
    mac_port = {}
    pending = []  # (time, seq, port, frame)
    seq = 0
    silent = set()
    stats = {"frames": 0, "bytes": 0, "dropped_queue": 0, "dropped_blackhole": 0}
    port_of_fd = {fd: i for i, fd in enumerate(taps)}
    watched = list(taps) + ([control] if control is not None else [])
    commands = b""
    while True:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, port, frame = heapq.heappop(pending)
            if port in silent:
                stats["dropped_blackhole"] += 1
                continue
            try:
                os.write(taps[port], frame)
            except OSError:  # the host's receive queue is full: dropped, as a NIC would
                stats["dropped_queue"] += 1
        timeout = max(0.0, pending[0][0] - now) if pending else 1.0
        ready, _, _ = select.select(watched, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            if fd == control:
                data = os.read(control, 4096)  # unbuffered: select sees every line
                if not data:
                    return
                commands += data
                while b"\n" in commands:
                    line, commands = commands.split(b"\n", 1)
                    words = line.decode().split()
                    if words[:1] == ["shape"]:
                        for u in uplinks:
                            u.rate, u.delay = float(words[1]) * 1e6 / 8, float(words[2]) / 1e3
                    elif words[:1] == ["blackhole"]:
                        silent.add(int(words[1]))
                    elif words[:1] == ["restore"]:
                        silent.discard(int(words[1]))
                    elif words[:1] == ["stats"]:
                        print(" ".join(f"{k}={v}" for k, v in stats.items()), flush=True)
                continue
            src = port_of_fd[fd]
            while True:
                try:
                    frame = os.read(fd, 70000)
                except BlockingIOError:
                    break
                if len(frame) < VNET_HDR + 14:
                    continue
                if src in silent:
                    stats["dropped_blackhole"] += 1
                    continue
                eth = VNET_HDR
                mac_port[frame[eth + 6:eth + 12]] = src
                at = uplinks[src].arrival(now, wire_bytes(frame))
                if at is None:
                    stats["dropped_queue"] += 1
                    continue
                stats["frames"] += 1
                stats["bytes"] += len(frame) - VNET_HDR
                dst = frame[eth:eth + 6]
                ports = [mac_port[dst]] if not (dst[0] & 1) and dst in mac_port else \
                    [p for p in range(len(taps)) if p != src]
                for p in ports:
                    seq += 1
                    heapq.heappush(pending, (at, seq, p, frame))


class Switch:
    """A shaped switch in a child process: hosts = [(namespace, interface)] in the order of addrs."""

    def __init__(self, tag, addrs, rate_mbit=0, delay_ms=0, queue_ms=200):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), tag, *addrs, "--rate-mbit",
                                      str(rate_mbit), "--delay-ms", str(delay_ms), "--queue-ms", str(queue_ms)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError("shaped_switch.py did not start (see its error above)")
        self.hosts = [(f"{tag}h{i}", f"{tag}e{i}") for i in range(len(addrs))]

    def _send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def shape(self, rate_mbit, delay_ms):
        self._send(f"shape {rate_mbit} {delay_ms}")

    def blackhole(self, host):
        self._send(f"blackhole {host}")

    def restore(self, host):
        self._send(f"restore {host}")

    def stats(self):
        self._send("stats")
        return dict(kv.split("=") for kv in self.proc.stdout.readline().split())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag")
    ap.add_argument("addrs", nargs="+")
    ap.add_argument("--rate-mbit", type=float, default=100)
    ap.add_argument("--delay-ms", type=float, default=25)
    ap.add_argument("--queue-ms", type=float, default=200)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("shaped_switch.py: needs root (network namespaces, tap devices)")
    taps = []
    for i, addr in enumerate(args.addrs):
        ns, ifname = f"{args.tag}h{i}", f"{args.tag}e{i}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        taps.append(open_tap(ns, ifname))
        for cmd in (["addr", "add", f"{addr}/24", "dev", ifname], ["link", "set", ifname, "up"], ["link", "set", "lo", "up"]):
            subprocess.run(["ip", "-n", ns] + cmd, check=True)
    print("ready", flush=True)
    serve(taps, args.rate_mbit * 1e6 / 8, args.delay_ms / 1e3, args.queue_ms / 1e3, sys.stdin.fileno())


if __name__ == "__main__":
    main()
