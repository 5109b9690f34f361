"""The coordinator's order journal (aloe-server --role coordinator --order_journal FILE, see
server/core/order_journal.h) read without protobuf: length-delimited aloe.v1.ShardOrder messages
(proto/shard_protocol.proto). Only the fields the soak needs are decoded."""

import struct

COMMIT, DISCARD, RESTORE, FORGET = 1, 2, 3, 4
KIND_NAMES = {COMMIT: "COMMIT", DISCARD: "DISCARD", RESTORE: "RESTORE", FORGET: "FORGET"}


class JournalError(ValueError):
    pass


def _varint(buf, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise JournalError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise JournalError("varint too long")


def _fields(buf):
    """(field number, wire type, value) of each field of one message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise JournalError(f"wire type {wire}")
        if pos > len(buf):
            raise JournalError("truncated field")
        yield field, wire, value


class Entry:
    __slots__ = ("worker_id", "update_id", "weight", "discount")

    def __init__(self, data):
        self.worker_id = self.update_id = 0
        self.weight = self.discount = 0.0
        for field, wire, value in _fields(data):
            if field == 1 and wire == 0:
                self.worker_id = value
            elif field == 2 and wire == 0:
                self.update_id = value
            elif field == 3 and wire == 5:
                self.weight = struct.unpack("<f", value)[0]
            elif field == 4 and wire == 5:
                self.discount = struct.unpack("<f", value)[0]

    def key(self):
        return (self.worker_id, self.update_id)


class Order:
    __slots__ = ("kind", "version", "entries")

    def __init__(self, data):
        self.kind, self.version, self.entries = 0, 0, []
        for field, wire, value in _fields(data):
            if field == 1 and wire == 0:
                self.kind = value
            elif field == 2 and wire == 0:
                self.version = value
            elif field == 3 and wire == 2:
                self.entries.append(Entry(value))


def parse(data):
    """Every whole order of a journal's bytes, and whether a cut last entry was dropped (a
    journal cut by a crash loses only its last entry)."""
    orders, pos = [], 0
    while pos < len(data):
        try:
            n, start = _varint(data, pos)
        except JournalError:
            return orders, True
        if start + n > len(data):
            return orders, True
        orders.append(Order(data[start:start + n]))
        pos = start + n
    return orders, False


def read(path):
    with open(path, "rb") as f:
        return parse(f.read())


class History:
    """What a journal says happened to every update: the COMMITs that stand (a RESTORE of v
    undoes every COMMIT above v written before it, CommittedHistory in order_journal.h), the
    commits undone that way, the DISCARDs, and the RESTOREs."""

    def __init__(self, orders):
        self.standing = []   # COMMIT orders that stand, in order
        self.undone = []     # (COMMIT order, version of the RESTORE that undid it)
        self.discarded = set()
        self.restores = []   # versions
        for o in orders:
            if o.kind == COMMIT:
                self.standing.append(o)
            elif o.kind == RESTORE:
                self.restores.append(o.version)
                while self.standing and self.standing[-1].version > o.version:
                    self.undone.append((self.standing.pop(), o.version))
            elif o.kind == DISCARD:
                self.discarded.update(e.key() for e in o.entries)
        self.undone.reverse()
        self.committed = {}  # (worker, update) -> version it formed
        for o in self.standing:
            for e in o.entries:
                self.committed[e.key()] = o.version
        self.undone_keys = {e.key() for o, _ in self.undone for e in o.entries}

    def gaps(self):
        """Versions missing from the standing commits (they must count up by one from the first
        RESTORE's version)."""
        if not self.standing:
            return []
        first = self.restores[0] + 1 if self.restores else self.standing[0].version
        want = first
        missing = []
        for o in self.standing:
            if o.version != want:
                missing.append((want, o.version))
            want = o.version + 1
        return missing

    def final_version(self):
        if self.standing:
            return self.standing[-1].version
        return self.restores[-1] if self.restores else 0
