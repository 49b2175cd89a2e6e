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
uplink (MBIT 0: no rate limit); "blackhole I" drops every frame to and from host I (a silent host:
no RST, no FIN, as `netem loss 100%`); "blackhole-mid-transfer I" does that from host I's next
frame of over 4 KB (bulk data: a transfer under way, not a heartbeat) and prints "silent I
UNIX_TIME"; "restore I" ends either; "stats" prints frames and bytes forwarded and what was
dropped (dropped_queue: TCP segments a full uplink queue dropped; dropped_host: frames a host's
receive queue refused; dropped_blackhole: frames). Namespaces are left for the caller to delete
(two_hosts.remove(TAG)); the taps go with this process. Needs root. From Python: Switch (below) starts one and sends these.
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
VIRTIO_NET_HDR_GSO_TCPV4 = 1
VNET_HDR = 12  # struct virtio_net_hdr_mrg_rxbuf: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers
# "blackhole-mid-transfer": a frame this large is bulk data, not a heartbeat or a quorum request
# (TCP sizes its TSO frames to ~1 ms at its pacing rate: ~12 KB at 100 Mbit/s).
BURST_FRAME = 4096
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


def gso_segments(frame):
    """(TCP segments, header bytes, segment payload) a frame from a tap stands for: (1, ., 0) when
    it is not a GSO frame."""
    _, gso_type, hdr_len, gso_size = struct.unpack_from("<BBHH", frame, 0)
    if gso_type == 0 or gso_size == 0:
        return 1, hdr_len, 0
    return max(1, -(-(len(frame) - VNET_HDR - hdr_len) // gso_size)), hdr_len, gso_size


def wire_bytes(frame):
    """Bytes the frame stands for on an Ethernet wire: one frame per TCP segment of a GSO frame."""
    segments, hdr_len, _ = gso_segments(frame)
    return len(frame) - VNET_HDR + (segments - 1) * hdr_len + segments * ETH_OVERHEAD


def segments_of(frame):
    """(segments, wire bytes of one full segment) of a TCP/IPv4 GSO frame; (1, its size) otherwise."""
    segments, hdr_len, gso_size = gso_segments(frame)
    if frame[1] != VIRTIO_NET_HDR_GSO_TCPV4 or segments == 1:
        return 1, wire_bytes(frame)
    return segments, hdr_len + gso_size + ETH_OVERHEAD


def ones_complement_add(a, b):
    s = a + b
    return (s & 0xFFFF) + (s >> 16)


def truncate_tcp4(frame, keep):
    """The first `keep` segments of a TCP/IPv4 GSO frame, as the frame a sender would have built
    for them: the IPv4 length and header checksum, and the TCP pseudo-header sum that the
    receiver's checksum offload completes (it counts the TCP length), follow the new size."""
    _, gso_type, hdr_len, gso_size = struct.unpack_from("<BBHH", frame, 0)
    f = bytearray(frame[:VNET_HDR + hdr_len + keep * gso_size])
    ip = VNET_HDR + 14
    ihl = (f[ip] & 0x0F) * 4
    old_len = struct.unpack_from("!H", f, ip + 2)[0]
    new_len = len(f) - ip
    struct.pack_into("!H", f, ip + 2, new_len)
    struct.pack_into("!H", f, ip + 10, 0)
    total = 0
    for i in range(0, ihl, 2):
        total = ones_complement_add(total, struct.unpack_from("!H", f, ip + i)[0])
    struct.pack_into("!H", f, ip + 10, ~total & 0xFFFF)
    # The partial TCP checksum holds the pseudo-header's sum, TCP length included: swap lengths.
    csum_at = ip + ihl + 16
    check = struct.unpack_from("!H", f, csum_at)[0]
    check = ones_complement_add(check, ~(old_len - ihl) & 0xFFFF)
    check = ones_complement_add(check, new_len - ihl)
    struct.pack_into("!H", f, csum_at, check)
    if keep == 1:
        struct.pack_into("<BBHH", f, 0, frame[0], 0, hdr_len, 0)  # one segment: no longer GSO
    return bytes(f)


class Uplink:
    """A host's link to the switch: serialization at `rate`, then `delay`; a drop-tail queue of
    queue_s of backlog. It drops segments, not GSO frames: the segments of a frame that still fit
    go on (tbf and netem segment a GSO packet that does not fit likewise), the rest are lost."""

    def __init__(self, rate, delay, queue_s):
        self.rate, self.delay, self.queue_s = rate, delay, queue_s
        self.free_at = 0.0

    def admit(self, now, frame):
        """(frame, segments dropped, when it reaches the switch's far side) for a frame sent at
        `now`; the frame is None when the queue is full, or the segments of it that fit. Rate 0:
        no limit."""
        if not self.rate:
            return frame, 0, now + self.delay
        start = max(now, self.free_at)
        segments, segment_wire = segments_of(frame)
        room = self.queue_s - (start - now)
        if room < 0:
            return None, segments, None
        keep = segments
        if segments > 1:
            keep = min(segments, int(room * self.rate / segment_wire) + 1)
            if keep < segments:
                frame = truncate_tcp4(frame, keep)
        self.free_at = start + wire_bytes(frame) / self.rate
        return frame, segments - keep, self.free_at + self.delay


def serve(taps, rate, delay, queue_s, control):
    uplinks = [Uplink(rate, delay, queue_s) for _ in taps]
    mac_port = {}
    pending = []  # (time, seq, port, frame)
    seq = 0
    silent = set()
    silent_at_burst = set()  # hosts to silence at their next large frame (a transfer under way)
    stats = {"frames": 0, "bytes": 0, "dropped_queue": 0, "dropped_host": 0, "dropped_blackhole": 0}
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
                stats["dropped_host"] += 1
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
                    elif words[:1] == ["blackhole-mid-transfer"]:
                        silent_at_burst.add(int(words[1]))
                    elif words[:1] == ["restore"]:
                        silent.discard(int(words[1]))
                        silent_at_burst.discard(int(words[1]))
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
                if src in silent_at_burst and len(frame) > BURST_FRAME:
                    silent_at_burst.discard(src)
                    silent.add(src)
                    print(f"silent {src} {time.time():.6f}", flush=True)
                if src in silent:
                    stats["dropped_blackhole"] += 1
                    continue
                eth = VNET_HDR
                mac_port[frame[eth + 6:eth + 12]] = src
                frame, lost, at = uplinks[src].admit(now, frame)
                stats["dropped_queue"] += lost
                if frame is None:
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

    def blackhole_mid_transfer(self, host, timeout=120):
        """Silences `host` as its next bulk transfer starts; returns that moment (time.time())."""
        self._send(f"blackhole-mid-transfer {host}")
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"shaped_switch.py: host {host} sent no bulk data within {timeout} s")
        line = self.proc.stdout.readline().split()
        if line[:2] != ["silent", str(host)]:
            raise RuntimeError(f"shaped_switch.py: expected 'silent {host} TIME', got {line}")
        return float(line[2])

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
