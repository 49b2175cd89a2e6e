#!/usr/bin/python3
"""Writes the fuzzers' starting inputs: a few well-formed AverageGradient requests and a checkpoint.

    tests/fuzz/make_seeds.py tests/fuzz/corpus
Protobuf is encoded by hand (no python3-protobuf needed).
"""
import os
import struct
import sys


def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint(num << 3 | wire)
    if wire == 0:
        return key + varint(payload)
    return key + varint(len(payload)) + payload


def tensor(dtype, shape, data, sparse=False, sparse_dim=0, nnz=0, indices=b""):
    t = field(1, 0, dtype) + field(2, 2, b"".join(varint(s) for s in shape)) + field(3, 2, data)
    if sparse:
        t += field(4, 0, 1) + field(5, 0, sparse_dim) + field(6, 0, nnz) + field(7, 2, indices)
    return t


def request(trainer, batch, bucket, t, chunk=None):
    r = field(1, 0, trainer) + field(2, 0, batch) + field(3, 0, bucket) + field(4, 2, t)
    if chunk:
        index, count, numel = chunk
        r += field(5, 0, index) + field(6, 0, count) + field(7, 0, numel)
    return r


def main():
    root = sys.argv[1]
    ps, ck = os.path.join(root, "ps_request"), os.path.join(root, "checkpoint")
    os.makedirs(ps, exist_ok=True)
    os.makedirs(ck, exist_ok=True)
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    seeds = {
        "dense_f32": request(0, 0, 0, tensor(1, [4], f32)),
        "dense_f64_2d": request(0, 1, 1, tensor(2, [2, 2], struct.pack("<4d", 1, 2, 3, 4))),
        "dense_f16": request(1, 2, 0, tensor(3, [2], struct.pack("<2e", 0.5, -1))),
        "dense_bf16": request(0, 3, 2, tensor(4, [2], b"\x80\x3f\x00\x40")),
        "sparse_f32": request(0, 4, 0, tensor(1, [8, 2], struct.pack("<2f", 1, 2), True, 1, 1, struct.pack("<q", 3))),
        "chunk_1_of_2": request(1, 5, 0, tensor(1, [2], struct.pack("<2f", 1, 2)), (1, 2, 4)),
        # Rows 4 and 6 of an 8 x 2 sparse gradient cut into 2 ranges; its values in the trainer's
        # region (the fuzzer points the region id at the attached one), room for 4 rows.
        "sparse_chunk_shm": request(0, 6, 0, tensor(1, [8, 2], b"", True, 1, 2, struct.pack("<2q", 4, 6)), (1, 2, 8))
        + field(8, 2, varint(1 << 3 | 1) + struct.pack("<Q", 1) + field(2, 0, 4096) + field(3, 0, 16) + field(4, 0, 32)),
    }
    for name, body in seeds.items():
        for auth, tag in ((0, ""), (1, "_wrong_token")):
            if tag and name != "dense_f32":
                continue
            with open(os.path.join(ps, name + tag), "wb") as f:
                f.write(bytes([auth]) + body)
    # A small checkpoint: two entries, the format of src/training/checkpoint.cpp.
    body = b"DDPKTNS1" + struct.pack("<Q", 2)
    for key, dtype, shape, data in (("meta/step", 4, [1], struct.pack("<q", 7)), ("w", 6, [2, 2], f32)):
        body += struct.pack("<I", len(key)) + key.encode() + struct.pack("<bB", dtype, len(shape))
        body += b"".join(struct.pack("<q", s) for s in shape) + struct.pack("<Q", len(data)) + data
    n, h = len(body), 0xCBF29CE484222325 ^ len(body)
    for i in range(0, n - n % 8, 8):
        h = ((h ^ struct.unpack_from("<Q", body, i)[0]) * 0x100000001B3) & (2**64 - 1)
    for i in range(n - n % 8, n):
        h = ((h ^ body[i]) * 0x100000001B3) & (2**64 - 1)
    with open(os.path.join(ck, "two_entries"), "wb") as f:
        f.write(body + struct.pack("<Q", h))


if __name__ == "__main__":
    main()
