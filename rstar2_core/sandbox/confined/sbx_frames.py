"""The control pipe's framing between the sandbox service (dispatcher.py) and its templates
(template.py), written once for both ends: each message is a pickle behind a 4-byte big-endian length.

    outbuf += frame({"cid": 1, "code": "print(1)"})      # the sender queues it on a non-blocking pipe
    inbuf += os.read(fd, n)
    for msg in unframe(inbuf): ...                      # every complete message, consumed from inbuf

Standard library only: the template imports it by file location (see ../template.py).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator

_LEN = struct.Struct(">I")


def frame(msg: object) -> bytes:
    """`msg` as one frame: its length, then its pickle."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def unframe(buf: bytearray) -> Iterator[object]:
    """Every complete message at the front of `buf`, each removed from it as it is yielded; a partial
    frame stays in `buf` for the next read."""
    while len(buf) >= _LEN.size:
        (n,) = _LEN.unpack_from(buf)
        if len(buf) < _LEN.size + n:
            return
        msg = pickle.loads(bytes(buf[_LEN.size:_LEN.size + n]))
        del buf[:_LEN.size + n]
        yield msg
