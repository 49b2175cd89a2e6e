#!/usr/bin/env python3
"""Plain TCP streams from this host to every other, for the floor of a collective's goodput
(bench/diloco_sites.py --goodput runs one of these per site, in its namespace):

  python3 bench/tcp_streams.py ME ADDR,ADDR,... MIB_PER_PEER [PORT]

Listens on ADDR[ME]:PORT and drains what the others send; connects to every other host, warms
each connection with 2 MiB, waits 1 s, then sends MIB_PER_PEER MiB on every connection at once
and prints one JSON line: {"host": ME, "seconds": until the last byte was written and every
peer had closed, "bytes": sent}. Exits once every peer's stream has ended.
"""
import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def main():
    me, addrs, mib = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 5001
    peers = [a for i, a in enumerate(addrs) if i != me]
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((addrs[me], port))
    server.listen(len(peers))
    drained = []

    def drain(conn):
        while conn.recv(CHUNK):
            pass
        conn.close()
        drained.append(1)

    def accept():
        for _ in peers:
            conn, _ = server.accept()
            threading.Thread(target=drain, args=(conn,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    socks = []
    deadline = time.time() + 30
    for a in peers:
        while True:
            try:
                socks.append(socket.create_connection((a, port), timeout=30))
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
    chunk = b"\0" * CHUNK
    for s in socks:
        s.sendall(chunk * 2)
    time.sleep(1.0)
    start = time.time()

    def send(s):
        for _ in range(mib):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the peer closes once it has read everything
    senders = [threading.Thread(target=send, args=(s,)) for s in socks]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    seconds = time.time() - start
    end = time.time() + 60
    while len(drained) < len(peers) and time.time() < end:
        time.sleep(0.05)
    print(json.dumps({"host": me, "seconds": seconds, "bytes": mib * CHUNK * len(peers)}), flush=True)


if __name__ == "__main__":
    main()
