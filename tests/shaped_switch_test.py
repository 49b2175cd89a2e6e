#!/usr/bin/env python3
"""tests/shaped_switch.py's link model without root: a full uplink queue drops the TCP segments
of a GSO frame that do not fit, not the frame; the frame cut to the rest is one a sender would
have built (IPv4 length and header checksum, the TCP pseudo-header sum the receiver's checksum
offload completes); the rate and the delay set the arrival times.

  python3 tests/shaped_switch_test.py
"""
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shaped_switch as sw  # noqa: E402

MSS = 1448
SRC, DST = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])


def fold(total):
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def words_sum(data):
    if len(data) % 2:
        data += b"\0"
    return fold(sum(struct.unpack(f"!{len(data) // 2}H", data)))


def pseudo_header_sum(tcp_length):
    return fold(words_sum(SRC + DST + struct.pack("!BBH", 0, 6, tcp_length)))


def gso_frame(segments, last=MSS):
    """A TCP/IPv4 GSO frame as Linux hands a tap: virtio header, Ethernet, IPv4, TCP, payload."""
    payload = bytes(range(256)) * ((MSS * segments) // 256 + 1)
    payload = payload[:MSS * (segments - 1) + last]
    tcp = struct.pack("!HHIIBBHHH", 5000, 6000, 1, 0, 5 << 4, 0x18, 65535, 0, 0)
    tcp_length = len(tcp) + len(payload)
    tcp = tcp[:16] + struct.pack("!H", pseudo_header_sum(tcp_length)) + tcp[18:]  # CHECKSUM_PARTIAL seed
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + tcp_length, 7, 0x4000, 64, 6, 0, SRC, DST)
    ip = ip[:10] + struct.pack("!H", ~words_sum(ip) & 0xFFFF) + ip[12:]
    eth = b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00"
    hdr_len = len(eth) + len(ip) + len(tcp)
    vnet = struct.pack("<BBHHHHH", 1, sw.VIRTIO_NET_HDR_GSO_TCPV4, hdr_len, MSS, hdr_len - 20, 16, 0)
    return vnet + eth + ip + tcp + payload


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")


def check_frame(frame, segments):
    ip = sw.VNET_HDR + 14
    tcp_length = len(frame) - ip - 20
    check(struct.unpack_from("!H", frame, ip + 2)[0] == len(frame) - ip, "IPv4 total length")
    check(words_sum(frame[ip:ip + 20]) == 0xFFFF, "IPv4 header checksum")
    check(struct.unpack_from("!H", frame, ip + 36)[0] == pseudo_header_sum(tcp_length), "TCP pseudo-header sum")
    got, _ = sw.segments_of(frame)
    check(got == segments, f"{segments} segments, got {got}")
    gso_type = frame[1]
    check(gso_type == (sw.VIRTIO_NET_HDR_GSO_TCPV4 if segments > 1 else 0), "GSO type")


def main():
    full = gso_frame(10)
    check(sw.segments_of(full)[0] == 10, "a 10-segment frame")
    check_frame(full, 10)
    for keep in (9, 4, 1):
        cut = sw.truncate_tcp4(full, keep)
        check_frame(cut, keep)
        check(cut[sw.VNET_HDR + 14 + 40:] == full[sw.VNET_HDR + 14 + 40:][:keep * MSS], "payload kept in order")
    check(sw.segments_of(gso_frame(3, last=100))[0] == 3, "a short last segment counts")

    rate, delay = 12.5e6, 0.025
    seg_wire = sw.segments_of(full)[1]
    link = sw.Uplink(rate, delay, queue_s=0.002)
    frame, lost, at = link.admit(0.0, full)
    check(lost == 0 and frame == full, "an empty queue takes the whole frame")
    check(abs(at - (sw.wire_bytes(full) / rate + delay)) < 1e-9, "arrival = serialization + delay")
    # The queue now holds ~1.2 ms of the first frame: in the 2 ms queue only part of one more fits
    # (its segments that start within the queue's room).
    backlog = link.free_at
    frame, lost, at = link.admit(0.0, full)
    room_segments = int((0.002 - backlog) * rate / seg_wire) + 1
    check(1 < room_segments < 10, f"the test's arithmetic: {room_segments} segments of room")
    check(frame is not None and lost == 10 - room_segments and sw.segments_of(frame)[0] == room_segments,
          f"a full queue keeps {room_segments} segments, dropped {lost}")
    check_frame(frame, room_segments)
    frame, lost, _ = link.admit(0.0, full)
    check(frame is None and lost == 10, "past the queue's room the whole frame is dropped")
    unlimited = sw.Uplink(0, delay, 0.001)
    frame, lost, at = unlimited.admit(1.0, full)
    check(frame == full and lost == 0 and at == 1.0 + delay, "rate 0: no limit, only the delay")
    print("shaped switch: segment drops, cut frames and arrival times as modelled")


if __name__ == "__main__":
    main()
